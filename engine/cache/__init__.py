"""The cache of per-sequence state shared by every job of a generator: fixed-size pages of
key/value slots (or of latent attention's compressed rows), recurrent-state slots, and snapshots
of that state for prefix reuse."""

from engine.cache.latent import LatentCacheLayer
from engine.cache.paged import KVCacheLayer, PagedKVCache
from engine.cache.pages import PageAllocator, page_keys
from engine.cache.recurrent import RecurrentStateLayer, StateSlots
from engine.cache.snapshots import SnapshotPool
from engine.cache.state import KVPages, LatentPages, RecurrentState

__all__ = [
    "KVCacheLayer",
    "KVPages",
    "LatentCacheLayer",
    "LatentPages",
    "PageAllocator",
    "PagedKVCache",
    "RecurrentState",
    "RecurrentStateLayer",
    "SnapshotPool",
    "StateSlots",
    "page_keys",
]
