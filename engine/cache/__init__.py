"""The paged KV cache: fixed-size pages of key/value slots shared by every job of a generator."""

from engine.cache.paged import KVCacheLayer, PagedKVCache
from engine.cache.pages import PageAllocator, page_keys

__all__ = ["KVCacheLayer", "PageAllocator", "PagedKVCache", "page_keys"]
