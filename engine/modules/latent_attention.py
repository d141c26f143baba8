"""Multi-head latent attention (MLA; DeepSeek-AI, "DeepSeek-V2", 2024), over a cache of compressed
rows.

Per token, ``kv_a_proj`` gives a latent ``c`` (``kv_lora_rank`` numbers, RMS-normalised) and
one key part ``k_r`` (``qk_rope_head_dim`` numbers, rotated by position) that every head shares;
``kv_b_proj`` expands ``c`` into each head's positionless key part ``U_h c`` and value
``V_h c``. A head's query is ``q_proj(x)``, or the low-rank ``q_b_proj(norm(q_a_proj(x)))``,
split the same way into a positionless part ``q_h`` and a rotated part ``q_rh``. The score of a
head is ``(q_h . U_h c + q_rh . k_r) * scale``.

The cache keeps only the row ``[c | k_r]`` per position (:class:`~engine.cache.state.LatentPages`),
and attention reads it two ways that compute the same function:

- *decompressed* (a prompt's chunk): every cached row is expanded into per-head keys and values
  once per step, then it is plain attention; the expansion is shared by all the chunk's queries.
- *absorbed* (a decode step): ``q_h . U_h c = (U_h^T q_h) . c`` and ``sum_t p_t V_h c_t = V_h
  (sum_t p_t c_t)``, so ``U_h`` is folded into the query and ``V_h`` applied after the weighted
  sum. Every head then attends over the rows themselves, as one key/value head shared by all
  heads, and nothing per head is made per cached position: one query reads ``width`` numbers per
  position instead of ``heads * (key + value)``, which is what makes the compressed cache pay.

Rotation: checkpoints made for DeepSeek's own code pair rotary dimensions ``(2i, 2i + 1)``
(``rope_interleave``); those are first regrouped as evens then odds, after which the usual
rotate-half rotation applies. Queries and cached keys are regrouped alike, so scores are
unchanged (transformers stores the rotated keys in the same regrouped order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.modules.attention import attend
from engine.modules.batch import BatchLayout, SequenceSlice
from engine.modules.linear import LinearSite
from engine.modules.rope import RopeSpec, RotaryEmbedding


def softmax_scale(qk_head_dim: int, rope: RopeSpec | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` where the RoPE is scaled and its parameters
    give ``mscale_all_dim``: YaRN's attention temperature applied to the whole score, the
    positionless part too (DeepSeek's reference, and transformers for any scaled RoPE). The
    rotation's cos/sin carry only the ratio of ``mscale`` to ``mscale_all_dim``."""
    scale = qk_head_dim**-0.5
    if rope is None or rope.kind == "default":
        return scale
    all_dims, factor = rope.params.get("mscale_all_dim"), rope.params.get("factor")
    if all_dims and factor and factor > 1:
        mscale = 0.1 * all_dims * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class LatentShape:
    """The sizes of a latent attention layer (the config's names in parentheses)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def width(self) -> int:
        """Numbers per cached position: the latent, then the shared rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs ``(2i, 2i + 1)`` regrouped as ``i`` and ``i + d/2``: the rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention over a :class:`~engine.cache.latent.LatentCacheLayer`.

    ``q_a_proj`` and ``q_a_norm`` are None where queries come from ``q_proj`` alone (no query
    LoRA); then ``q_proj`` is the checkpoint's ``q_proj``, else its ``q_b_proj``.
    """

    def __init__(
        self,
        q_a_proj: nn.Module | None,
        q_a_norm: nn.Module | None,
        q_proj: nn.Module,
        kv_a_proj: nn.Module,
        kv_a_norm: nn.Module,
        kv_b_proj: nn.Module,
        o_proj: nn.Module,
        shape: LatentShape,
        scale: float,
        rope: RotaryEmbedding,
        interleaved: bool,
    ) -> None:
        super().__init__()
        if (q_a_proj is None) != (q_a_norm is None):
            raise ValueError("a query LoRA needs both q_a_proj and its norm")
        # Registered in the order they run: the converter writes a block's tensors in this order.
        self.q_a_proj, self.q_a_norm, self.q_proj = q_a_proj, q_a_norm, q_proj
        self.kv_a_proj, self.kv_a_norm, self.kv_b_proj = kv_a_proj, kv_a_norm, kv_b_proj
        self.o_proj = o_proj
        self.shape, self.scale, self.rope, self.interleaved = shape, scale, rope, interleaved
        # kv_b_proj's weight where the linear keeps none (a streaming EXL3 linear), decoded once:
        # (the linear it came from, the weight in the dtype last asked for).
        self._decoded: tuple[nn.Module, torch.Tensor] | None = None

    def quantizable_linears(self) -> list[LinearSite]:
        sites = [LinearSite("q_a", self, "q_a_proj")] if self.q_a_proj is not None else []
        return sites + [
            LinearSite("q", self, "q_proj"),
            LinearSite("kv_a", self, "kv_a_proj"),
            LinearSite("kv_b", self, "kv_b_proj"),
            LinearSite("o", self, "o_proj"),
        ]

    # -- projections ----------------------------------------------------------------------

    def _queries(self, x: torch.Tensor, tables) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's positionless query part ``[rows, heads, nope]`` and rotated part
        ``[rows, heads, rope]``."""
        s = self.shape
        source = x if self.q_a_proj is None else self.q_a_norm(self.q_a_proj(x))
        q = self.q_proj(source).view(-1, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim)
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        if self.interleaved:
            q_rope = deinterleave(q_rope)
        return q_nope, self.rope.apply(q_rope, tables)

    def _rows(self, x: torch.Tensor, tables) -> torch.Tensor:
        """The cache rows ``[rows, width]`` of this step's tokens: normalised latent, rotated key."""
        s = self.shape
        latent, k_rope = self.kv_a_proj(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        if self.interleaved:
            k_rope = deinterleave(k_rope)
        k_rope = self.rope.apply(k_rope[:, None, :], tables)[:, 0, :]
        return torch.cat((self.kv_a_norm(latent), k_rope), dim=-1)

    def _expansion(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: ``U`` ``[heads, nope, kv_lora_rank]`` (keys) and ``V``
        ``[heads, v, kv_lora_rank]`` (values), views of the linear's own weight where it keeps
        one (dense; EXL3 reconstructed once at load), else decoded once and kept while that
        linear stays (the converter swaps linears for quantized ones)."""
        s, linear = self.shape, self.kv_b_proj
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor):
            if self._decoded is None or self._decoded[0] is not linear or self._decoded[1].dtype != dtype:
                self._decoded = (linear, linear.reconstruct().to(dtype))
            weight = self._decoded[1]
        per_head = weight.to(dtype).view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return per_head[:, : s.qk_nope_head_dim], per_head[:, s.qk_nope_head_dim :]

    # -- attention ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        tables = batch.rope_tables(self.rope, x.dtype)
        q_nope, q_rope = self._queries(x, tables)
        cache.write(batch.write_slots, self._rows(x, tables))
        if batch.decode is not None:
            out = self._decode(q_nope, q_rope, batch, cache)
        else:
            out = torch.empty(
                x.shape[0], self.shape.num_heads, self.shape.v_head_dim, dtype=x.dtype, device=x.device
            )
            for seq in batch.sequences:
                rows = seq.rows
                if seq.length == 1:  # a decode step in a mixed batch
                    cached = cache.read(seq.slots[: seq.end_position]).to(x.dtype)
                    out[rows] = self._absorbed(q_nope[rows], q_rope[rows], cached[None])
                else:
                    out[rows] = self._decompressed(q_nope[rows], q_rope[rows], seq, batch, cache)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _decompressed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, seq: SequenceSlice, batch: BatchLayout, cache
    ) -> torch.Tensor:
        """A chunk's queries over every cached row of its sequence, each row expanded into the
        heads' keys and values: ``[n, heads, v]``."""
        s = self.shape
        cached = cache.read(seq.slots[: seq.end_position]).to(q_nope.dtype)
        latent, k_rope = cached.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(-1, s.num_heads, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, s.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        positions = batch.positions[seq.rows]
        keys_at = batch.key_positions(0, seq.end_position, q.device)
        return attend(q, k, v, positions, keys_at, self.scale)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cached: torch.Tensor,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per sequence over its cached rows, ``kv_b_proj`` folded into the query and
        the output: ``q_nope``/``q_rope`` ``[batch, heads, .]``, ``cached`` ``[batch, L, width]``,
        ``visible`` ``[batch, L]`` (None: every row). Returns ``[batch, heads, v]``."""
        s = self.shape
        up_k, up_v = self._expansion(q_nope.dtype)
        # U_h^T q_h for every head: the query in the latent's coordinates, [batch, heads, rank].
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, up_k)
        query = torch.cat((q_latent, q_rope), dim=-1)  # against [c | k_r]
        scores = torch.matmul(query, cached.transpose(1, 2)).float() * self.scale  # [batch, heads, L]
        if visible is not None:
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(cached.dtype)
        mixed = torch.matmul(weights, cached[..., : s.kv_lora_rank])  # sum_t p_t c_t, [batch, heads, rank]
        return torch.einsum("bhr,hvr->bhv", mixed, up_v)

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        """A fixed-shape decode step: every row one sequence's next token, its rows gathered from
        the padded block tables and masked past its length (no host work: graph-safe)."""
        d = batch.decode
        offsets = torch.arange(d.page_size, device=q_nope.device)
        slots = (d.block_tables.long()[:, :, None] * d.page_size + offsets).reshape(-1)
        cached = cache.read(slots).view(q_nope.shape[0], -1, self.shape.width).to(q_nope.dtype)
        positions = torch.arange(cached.shape[1], device=q_nope.device)
        visible = positions[None, :] < d.lengths.long()[:, None]
        return self._absorbed(q_nope, q_rope, cached, visible)
