"""Key/value storage in pages, one tensor pair per layer.

Storage is ``[num_pages * page_size, kv_heads, head_dim]`` per layer: a cache *slot* is a row,
and page ``p`` owns slots ``p * page_size .. (p + 1) * page_size - 1``. A sequence's block table
(its list of pages) turns positions into slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.pages import PageAllocator


class KVCacheLayer:
    """One layer's keys and values, stored at the cache's dtype."""

    def __init__(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.k = torch.zeros(num_slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.index_select(0, slots), self.v.index_select(0, slots)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


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
    ) -> None:
        self.page_size, self.num_pages = page_size, num_pages
        self.device = torch.device(device)
        self.pages = PageAllocator(num_pages, page_size)
        self._layers = [
            KVCacheLayer(num_pages * page_size, kv_heads, head_dim, dtype, self.device) for _ in range(num_layers)
        ]

    @classmethod
    def for_model(cls, spec, max_tokens: int, page_size: int = 64, dtype=None, device="cpu") -> PagedKVCache:
        """A cache holding ``max_tokens`` positions in total, shaped for the model ``spec``."""
        num_pages = max(1, -(-max_tokens // page_size))
        return cls(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages, page_size, dtype or torch.float32, device
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
