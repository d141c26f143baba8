"""Rotary position embeddings (Su et al., 2021) and the context-extension schemes models use.

A :class:`RopeSpec` is read from the model's config; :func:`inverse_frequencies` turns it into
the per-dimension rotation speeds, and :class:`RotaryEmbedding` rotates queries and keys at
given absolute positions. Rotation pairs dimension ``i`` with ``i + d/2`` (the "rotate half"
layout of Hugging Face checkpoints), over the first ``rotary_dim`` dimensions of each head.
Families that rotate adjacent pairs ``(2i, 2i + 1)`` instead (Ernie 4.5) have their queries and
keys reordered into halves first (:meth:`RotaryEmbedding.halves_from_pairs`). nanochat turns
the other way (``RopeSpec.reverse``: negated speeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine import kernels
from engine.errors import ModelLoadError


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | longrope | proportional
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    adjacent_pairs: bool = False  # rotates (2i, 2i + 1) rather than (i, i + d/2)
    reverse: bool = False  # turns by -angle: nanochat's rotate-half has its signs flipped


def _default(spec: RopeSpec, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (spec.theta**exponents)


def _llama3(spec: RopeSpec, dim: int) -> torch.Tensor:
    """Llama 3.1: slow dimensions are interpolated by ``factor``, fast ones kept, a ramp between."""
    inv = _default(spec, dim)
    p = spec.params
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): interpolate slow dimensions, extrapolate fast ones, and scale
    attention logits (through cos/sin) by ``attention_factor``."""
    p = spec.params
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or spec.max_position_embeddings
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv, float(attention_factor)


def _longrope(spec: RopeSpec, dim: int, context: int) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE: per-dimension rescaling factors, "short" within the original context and
    "long" beyond it. We choose once, from the context the cache will hold, so every cached key
    was rotated the same way."""
    p = spec.params
    orig = p.get("original_max_position_embeddings") or spec.max_position_embeddings
    factors = p["long_factor"] if context > orig else p["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float32)
    inv = 1.0 / (ext * spec.theta ** (torch.arange(0, dim, 2).float() / dim))
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        scale = spec.max_position_embeddings / orig
        attention_factor = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(orig))
    return inv, float(attention_factor)


def _proportional(spec: RopeSpec, dim: int) -> torch.Tensor:
    """Gemma 4's "proportional" RoPE (p-RoPE): the first ``partial_rotary_factor`` of the head's
    pairs turn at the speeds of a ``dim``-wide rotation (exponents over the whole head, not over
    the rotated part), the others at speed zero (cos 1, sin 0: they pass unrotated). So the
    rotation spans the whole head, in the usual (i, i + d/2) pairing."""
    angles = int(spec.partial_rotary_factor * dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim
    inv = torch.cat((1.0 / (spec.theta**exponents), torch.zeros(dim // 2 - angles)))
    return inv / float(spec.params.get("factor", 1.0))


def inverse_frequencies(spec: RopeSpec, dim: int, context: int) -> tuple[torch.Tensor, float]:
    """Rotation speeds for ``dim`` rotary dimensions, and the factor applied to cos/sin."""
    if spec.kind == "proportional":
        return _proportional(spec, dim), 1.0
    if spec.kind == "default":
        return _default(spec, dim), 1.0
    if spec.kind == "linear":
        return _default(spec, dim) / spec.params["factor"], 1.0
    if spec.kind == "llama3":
        return _llama3(spec, dim), 1.0
    if spec.kind == "yarn":
        return _yarn(spec, dim)
    if spec.kind == "longrope":
        return _longrope(spec, dim, context)
    raise ModelLoadError(f"unsupported rope scaling type '{spec.kind}'")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, spec: RopeSpec, head_dim: int, context: int) -> None:
        super().__init__()
        # Proportional RoPE rotates the whole head (its unrotated pairs turn at speed zero).
        partial = 1.0 if spec.kind == "proportional" else spec.partial_rotary_factor
        self.rotary_dim = int(head_dim * partial)
        self.adjacent_pairs = spec.adjacent_pairs
        inv, self.attention_factor = inverse_frequencies(spec, self.rotary_dim, context)
        if spec.reverse:  # cos is even and sin odd: negated speeds are the reversed rotation
            inv = -inv
        self.register_buffer("inv_freq", inv, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, ``[tokens, 1, rotary_dim]``, for absolute ``positions``."""
        if positions.is_cuda:  # one launch instead of nine, the same numbers
            fused = kernels.fused.rope_tables(positions, self.inv_freq, self.attention_factor, dtype)
            if fused is not None:
                return fused
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(dtype)[:, None, :]
        return cos, sin

    def apply_pair(
        self, q: torch.Tensor, k: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`apply` to queries and keys; on the GPU one fused launch does both."""
        if q.is_cuda:
            fused = kernels.fused.rope(q, k, *tables)
            if fused is not None:
                return fused
        return self.apply(q, tables), self.apply(k, tables)

    def halves_from_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[..., head_dim]``) with its rotary dims reordered from adjacent pairs
        ``x0 x1 x2 x3 ...`` to halves ``x0 x2 ... x1 x3 ...``: the "rotate half" rotation of the
        result is the adjacent-pair rotation of ``x``, so reordered. Attention reorders queries and
        keys alike (and caches the keys so): their dot products, all it reads of them, are unchanged,
        and every rotary path (the GPU kernels too) works in one layout."""
        r = self.rotary_dim
        halves = torch.cat((x[..., 0:r:2], x[..., 1:r:2]), dim=-1)
        return halves if r == x.shape[-1] else torch.cat((halves, x[..., r:]), dim=-1)

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x`` (``[tokens, heads, head_dim]``) in place of its first rotary dims."""
        cos, sin = tables
        if self.rotary_dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
