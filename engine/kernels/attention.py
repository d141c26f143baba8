"""Decode attention over the paged KV cache, and the kernels that write and read the cache.

Each function returns its result, or None where no kernel applies (CPU tensors, no extension, a
case the kernels do not cover): the caller then runs its torch path. Cache stores are passed in,
not imported: a dense store has ``data`` ``[slots, kv_heads, head_dim]``; a quantized one has
``codes``, ``scales``, ``bits``, ``group`` and ``head_dim`` (``engine.cache.quantized``).
"""

from __future__ import annotations

import torch

from engine.kernels import loader
from engine.kernels.loader import KERNEL_DTYPES

PAGED_HEAD_DIMS = (64, 128, 256, 512)  # ext/paged_attention.cu instantiations (512: version 2 only)


def paged_decode_attention(
    q: torch.Tensor,
    layer,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    tensor_cores: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode attention over the paged cache on the GPU (``ext/paged_attention.cu``), the same
    function as ``engine.cache.decode_attention.paged_decode_attention_reference``.

    Graph-safe: no host sync; the split count depends only on the shapes (``block_tables``' width).
    ``tensor_cores=False`` runs version 2 (CUDA cores) where version 3 (tensor cores) would run:
    version 3 is the faster one (docs/KERNELS.md section 5), version 2 covers the other cases, and
    tests and ``bench-attention --compare-v2`` compare the two. ``sinks`` ``[heads]``: learned
    sink logits (GPT-OSS), added once per head by the kernel's split combine.
    """
    ext = loader.kernel_ready(q, block_tables, lengths)
    if ext is None or not hasattr(ext, "paged_decode_attention"):
        return None
    if q.ndim != 3 or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[2] not in PAGED_HEAD_DIMS:
        return None
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per head ({q.shape[1]}), got shape {tuple(sinks.shape)}")
    k_side, v_side = cache_side(layer.keys, q), cache_side(layer.values, q)
    if k_side is None or v_side is None or q.shape[1] % k_side[0] != 0:
        return None
    if sinks is not None:  # the layer keeps them fp32 on its device: then no copy per step
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    return ext.paged_decode_attention(
        q.contiguous(),
        *k_side[1:],
        *v_side[1:],
        block_tables.to(torch.int32).contiguous(),
        lengths.to(torch.int32).contiguous(),
        int(page_size),
        float(scale),
        int(window or 0),
        float(softcap or 0.0),
        tensor_cores=tensor_cores,
        sinks=sinks,
    )


def cache_side(store, q: torch.Tensor) -> tuple | None:
    """``(kv_heads, dense, codes, scales, bits)`` of a cache store for the attention kernel, or None
    where it cannot read the store."""
    data = getattr(store, "data", None)
    if data is not None:  # a dense store: must already be in q's dtype (no conversion per step)
        if data.dtype != q.dtype or not data.is_cuda or not data.is_contiguous():
            return None
        return data.shape[1], data, None, None, 16
    codes = getattr(store, "codes", None)
    if codes is None or getattr(store, "group", None) != 32 or not codes.is_cuda:
        return None
    return codes.shape[1], None, codes, store.scales, store.bits


def quantized_cache_write(store, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """Quantize ``x`` ``[n, kv_heads, head_dim]`` into a quantized store at ``slots`` with one
    fused kernel (``ext/paged_attention.cu``); returns the store's codes, written. None where it
    does not apply (CPU, no extension, groups other than 32): the store then runs its torch path.

    Codes equal the store's ``quantize`` except where a rotated number lands within float32
    rounding of a level boundary (the kernel rotates with a butterfly, torch with a matmul, so the
    rotated numbers may differ in the last bit).
    """
    ext = loader.kernel_ready(x, store.codes, slots)
    if ext is None or not hasattr(ext, "quantized_cache_write") or store.group != 32:
        return None
    if x.dtype not in KERNEL_DTYPES or x.ndim != 3 or x.shape[2] != store.head_dim:
        return None
    slots = slots.to(torch.int64).contiguous()
    ext.quantized_cache_write(x.contiguous(), slots, store.codes, store.scales, store.bits)
    return store.codes


QUANTIZED_READ_DTYPES = (torch.float16, torch.bfloat16)  # ext/quantized_cache_read.cu outputs
QUANTIZED_READ_MAX_UNITS = 2**31 - 1 - 256  # 8-number units per launch (its int32 thread index)


def quantized_cache_read(store, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows ``slots`` of a quantized store, dequantized to ``[n, kv_heads, head_dim]`` in ``dtype``
    by one gather-dequantize-rotate kernel (``ext/quantized_cache_read.cu``). Graph-safe.

    None where it does not apply (CPU, no extension, groups other than 32, an output dtype other
    than fp16/bf16: fp32 reads are the exact references the tests compare against); the store then
    runs its torch path. Results are within fp32 rounding of the store's ``dequantize`` before the
    cast to ``dtype`` (at most one unit in the last place of ``dtype`` apart).
    """
    if dtype not in QUANTIZED_READ_DTYPES or store.group != 32:
        return None
    if slots.numel() * store.codes.shape[1] * (store.head_dim // 8) > QUANTIZED_READ_MAX_UNITS:
        return None  # beyond the kernel's 32-bit thread index (32 GB of output: never in practice)
    ext = loader.kernel_ready(store.codes, slots)
    if ext is None or not hasattr(ext, "quantized_cache_read"):
        return None
    slots = slots.to(torch.int64).contiguous()
    return ext.quantized_cache_read(store.codes, store.scales, slots, store.bits, dtype)


def dense_cache_sides(keys, values, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(keys tensor, values tensor)`` of two dense cache stores where ``k`` and ``v`` ``[n,
    kv_heads, head_dim]`` (heads contiguous, rows may be strided) go into them at ``slots`` as they
    are (same dtype, the stores' row shapes, one slot per token), else None."""
    kd, vd = getattr(keys, "data", None), getattr(values, "data", None)
    if kd is None or vd is None or slots.ndim != 1:
        return None
    if not k.dtype == v.dtype == kd.dtype == vd.dtype:
        return None
    if not (kd.is_contiguous() and vd.is_contiguous()) or kd.shape[0] != vd.shape[0]:
        return None
    if k.ndim != 3 or v.ndim != 3 or k.shape[1:] != kd.shape[1:] or v.shape[1:] != vd.shape[1:]:
        return None
    if not k.shape[0] == v.shape[0] == slots.shape[0]:
        return None
    if any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (k, v)):
        return None
    return kd, vd


def kv_cache_write(
    keys, values, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Write ``k`` and ``v`` ``[n, kv_heads, head_dim]`` into two dense cache stores at ``slots``
    with one kernel instead of two ``index_copy_``; returns the two cache tensors, written. None
    where it does not apply (CPU, no extension, a quantized side, a dtype conversion, heads not
    contiguous): the stores then write themselves. Graph-safe."""
    sides = dense_cache_sides(keys, values, slots, k, v)
    if sides is None or k.dtype not in KERNEL_DTYPES:
        return None
    ext = loader.kernel_ready(k, v, *sides, slots)
    if ext is None or not hasattr(ext, "kv_cache_write"):
        return None
    ext.kv_cache_write(k, v, slots.to(torch.int64).contiguous(), *sides)
    return sides
