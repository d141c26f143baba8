"""Fused elementwise kernels of the decode step (``ext/fused_ops.cu``): RMSNorm, residual add +
RMSNorm, RoPE tables, RoPE (optionally with the KV write) and the gated activation.

In a decode step each of these would be a chain of 3-8 torch kernels; in a CUDA graph every kernel
still costs its launch slot, so one launch each, keeping torch's roundings (results agree to one
rounding of the dtype, most bit for bit). Each returns its result, or None where it does not apply
(CPU tensors, no extension, a layout the kernel does not take): the caller runs its torch code.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.kernels import loader
from engine.kernels.attention import dense_cache_sides
from engine.kernels.loader import KERNEL_DTYPES

# The gated MLP's activations the kernel applies, by the names configs use.
ACT_IDS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_tanh": 1, "gelu": 2, "relu": 3}


def _fused_ready(*tensors: torch.Tensor) -> ModuleType | None:
    if not all(t.dtype in KERNEL_DTYPES for t in tensors):
        return None
    ext = loader.kernel_ready(*tensors)
    return ext if ext is not None and hasattr(ext, "rms_norm") else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor | None:
    """RMSNorm over the last dim of ``x`` (``x / rms * (offset + weight)``, Llama's or Gemma's
    rounding by ``offset``) in one launch."""
    ext = _fused_ready(x, weight)
    if ext is None or weight.dtype != x.dtype or x.shape[-1] != weight.numel() or x.stride(-1) != 1:
        return None
    if not weight.is_contiguous():  # a copy is a kernel's output: a chained norm reads weights early
        return None
    rows = x.reshape(-1, x.shape[-1])
    return ext.rms_norm(rows, weight, eps, offset).view(x.shape)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(h + delta, RMSNorm(h + delta))`` in one launch: the residual add fused with the next norm.
    The sum is bit-identical to torch's ``h + delta``; the norm equals :func:`rms_norm` of it."""
    ext = _fused_ready(h, delta, weight)
    if ext is None or not hasattr(ext, "add_rms_norm"):
        return None
    # Checked here, not in the extension (docs/KERNELS.md, "Pitfalls").
    if not h.dtype == delta.dtype == weight.dtype or h.shape != delta.shape or h.ndim == 0:
        return None
    if h.shape[-1] != weight.numel() or h.stride(-1) != 1 or delta.stride(-1) != 1:
        return None
    if not weight.is_contiguous():  # see rms_norm
        return None
    n = h.shape[-1]
    h_out, y = ext.add_rms_norm(h.reshape(-1, n), delta.reshape(-1, n), weight, eps, offset)
    return h_out.view(h.shape), y.view(h.shape)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE's cos and sin ``[tokens, 1, 2 * len(inv_freq)]`` in ``dtype`` for int64 ``positions``
    in one launch (torch's formula is nine), with torch's fp32 operations in torch's order: equal
    to ``engine.modules.rope.RotaryEmbedding.tables`` bit for bit."""
    if dtype not in KERNEL_DTYPES or positions.dtype != torch.int64 or positions.ndim != 1:
        return None
    ext = loader.kernel_ready(positions)
    if ext is None or not hasattr(ext, "rope_tables"):
        return None
    cos, sin = ext.rope_tables(positions.contiguous(), inv_freq.float().contiguous(), factor, dtype)
    return cos, sin


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotate-half RoPE of ``q`` and ``k`` ``[tokens, heads, d]`` with ``[tokens, 1, rot]`` tables."""
    ext = _fused_ready(q, k, cos, sin)
    if ext is None or q.ndim != 3 or k.ndim != 3 or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return None
    if any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (q, k)):
        return None
    q_out, k_out = ext.rope(q, k, cos.contiguous(), sin.contiguous())
    return q_out, k_out


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys,
    values,
    slots: torch.Tensor,
) -> torch.Tensor | None:
    """:func:`rope` of ``q`` and ``k`` and the dense cache write
    (:func:`engine.kernels.attention.kv_cache_write`) of the rotated keys and ``v`` in one launch
    (one node fewer per layer where the GEMV's q/k/v epilogue does not apply); returns ``q``
    rotated, or None where either does not apply (the caller then runs them apart). Graph-safe."""
    sides = dense_cache_sides(keys, values, slots, k, v)
    if sides is None or k.shape != v.shape or q.ndim != 3 or slots.shape[0] != q.shape[0]:
        return None
    if not q.dtype == cos.dtype == sin.dtype == k.dtype or q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        return None
    ext = _fused_ready(q, k, v, cos, sin)
    if ext is None or not hasattr(ext, "rope_kv_write"):
        return None
    slots = slots.to(torch.int64).contiguous()
    return ext.rope_kv_write(q, k, v, cos.contiguous(), sin.contiguous(), slots, *sides)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor | None:
    """``act(gate) * up`` in one launch (the gated MLP's middle), rounding ``act(gate)`` to the
    dtype before the product as torch does."""
    ext = _fused_ready(gate, up)
    act = ACT_IDS.get(activation)
    if ext is None or act is None or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return None
    g, u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    return ext.act_mul(g, u, act).view(gate.shape)
