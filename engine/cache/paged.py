"""Key/value storage in pages, one tensor pair per layer.

Storage is ``[num_pages * page_size, kv_heads, head_dim]`` per layer (dense, or packed codes
and scales for a quantized cache): a cache *slot* is a row,
and page ``p`` owns slots ``p * page_size .. (p + 1) * page_size - 1``. A sequence's block table
(its list of pages) turns positions into slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import ops
from engine.cache.pages import PageAllocator
from engine.cache.quantized import SUPPORTED_BITS, DenseStore, QuantizedStore


class KVCacheLayer:
    """One layer's keys and values; each side dense or quantized (``engine.cache.quantized``)."""

    def __init__(self, keys, values, dtype: torch.dtype) -> None:
        self.keys, self.values, self.dtype = keys, values, dtype

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # Two dense sides on the GPU: one kernel writes both (else one index_copy_ per side).
        if ops.kv_cache_write(self.keys, self.values, slots, k, v):
            return
        self.keys.write(slots, k)
        self.values.write(slots, v)

    def write_rotated(
        self,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None:
        """Rotate ``q`` and ``k`` (rotate-half RoPE with ``tables``) and :meth:`write` the rotated
        keys and ``v`` in one launch; returns ``q`` rotated, or None where that launch does not
        apply (CPU, a quantized side): the caller then rotates and writes apart."""
        return ops.rope_kv_write(q, k, v, *tables, self.keys, self.values, slots)

    def project_rotated(
        self,
        group,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        head_dim: int,
    ) -> torch.Tensor | None:
        """A decode step's q/k/v projection ``group`` of ``x``, RoPE and :meth:`write` of the keys
        and values in one GEMV launch (``ops.exl3_qkv_rope_write``); returns q rotated, or None
        where that does not apply (then: ``group(x)`` and :meth:`write_rotated`)."""
        linears = list(group.linears)
        if len(linears) != 3 or any(len(s) != 1 for s in group.splits):  # separate q, k, v only
            return None
        return ops.exl3_qkv_rope_write(x, linears, tables, self.keys, self.values, slots, head_dim)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(slots, self.dtype), self.values.read(slots, self.dtype)

    def read_runs(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Keys and values at ``slots`` as views of the store, one per run of consecutive slots
        (a sequence's pages are mostly consecutive): no copy. Only for dense sides on the CPU, in
        the cache's dtype; None elsewhere (then :meth:`read`). Readers must not write to them."""
        dense = isinstance(self.keys, DenseStore) and isinstance(self.values, DenseStore)
        if slots.is_cuda or not dense or slots.numel() == 0 or self.keys.data.dtype != self.dtype:
            return None
        breaks = (torch.diff(slots) != 1).nonzero().flatten().tolist()
        starts, ends = [0] + [b + 1 for b in breaks], [b + 1 for b in breaks] + [slots.numel()]
        runs = []
        for start, end in zip(starts, ends):
            run = slice(int(slots[start]), int(slots[start]) + end - start)
            runs.append((self.keys.data[run], self.values.data[run]))
        return runs

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def make_store(num_slots: int, heads: int, head_dim: int, bits: int, dtype: torch.dtype, device):
    """A dense store for ``bits >= 16``, else a quantized one."""
    if bits >= 16:
        return DenseStore(num_slots, heads, head_dim, dtype, device)
    return QuantizedStore(num_slots, heads, head_dim, bits, device)


def parse_cache_bits(text: str | None) -> tuple[int, int]:
    """``"4"`` -> (4, 4); ``"4,6"`` -> keys 4, values 6; ``None``/``"16"`` -> unquantized."""
    if not text:
        return 16, 16
    try:
        parts = [int(p) for p in str(text).split(",")]
    except ValueError:
        parts = []  # not whole numbers: refused below with the same message
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or any(b not in (*SUPPORTED_BITS, 16) for b in parts):
        raise ValueError(f"--cache-bits takes K or K,V with each in 2..8 or 16, got '{text}'")
    return parts[0], parts[1]


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        bits: tuple[int, int] = (16, 16),
    ) -> None:
        self.page_size, self.num_pages, self.bits = page_size, num_pages, bits
        self.device = torch.device(device)
        self.pages = PageAllocator(num_pages, page_size)
        slots = num_pages * page_size
        self._layers = [
            KVCacheLayer(
                make_store(slots, kv_heads, head_dim, bits[0], dtype, self.device),
                make_store(slots, kv_heads, head_dim, bits[1], dtype, self.device),
                dtype,
            )
            for _ in range(num_layers)
        ]

    @classmethod
    def for_model(
        cls,
        spec,
        max_tokens: int,
        page_size: int = 64,
        dtype=None,
        device="cpu",
        bits: tuple[int, int] = (16, 16),
    ) -> PagedKVCache:
        """A cache holding ``max_tokens`` positions in total, shaped for the model ``spec``."""
        num_pages = max(1, -(-max_tokens // page_size))
        return cls(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            num_pages,
            page_size,
            dtype or torch.float32,
            device,
            bits,
        )

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, index: int) -> KVCacheLayer:
        return self._layers[index]

    def slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions ``start .. end - 1`` of a sequence with this block table."""
        positions = torch.arange(start, end)
        pages = torch.as_tensor(block_table, dtype=torch.long)[positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).to(self.device)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)
