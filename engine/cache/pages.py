"""Page bookkeeping: allocation, reference counts and prefix reuse.

A page holds ``page_size`` consecutive positions of one sequence. Once a page is full its
content is fixed, so it can be named by the tokens it holds *and everything before them*: its
key is a hash of its tokens chained with the previous page's key. Two sequences with the same
prefix get the same keys for the full pages of that prefix, and the second one can use the
first one's pages instead of computing them again (a chat's next turn, a shared system prompt).

Pages whose last user has finished stay cached, unreferenced, in least-recently-used order;
allocation takes never-used pages first and evicts cached ones only when it must. Whoever keeps
something per named page (the state snapshots of a model with recurrent layers,
``engine.cache.snapshots``) hears of each name the allocator forgets through ``on_forget``.
Without ``reuse_prefixes`` no page is ever named or matched.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine.errors import ContextOverflowError

_ROOT = b"trellis-page-root"


def page_keys(tokens: Sequence[int], page_size: int, previous: bytes | None = None) -> list[bytes]:
    """Chained keys of the full pages of ``tokens`` (a trailing partial page has none).

    ``previous``: the key of the page just before ``tokens`` when they continue a sequence whose
    earlier pages are already keyed (None: ``tokens`` start the sequence).
    """
    keys: list[bytes] = []
    previous = _ROOT if previous is None else previous
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[start : start + page_size]))
        previous = h.digest()
        keys.append(previous)
    return keys


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, reuse_prefixes: bool = True) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.reuse_prefixes = reuse_prefixes
        self.refcount = [0] * num_pages
        # A min-heap: an allocation takes the lowest free pages, so a sequence's pages tend to be
        # consecutive slots, which the CPU reads in place (KVCacheLayer.read_runs).
        self._free: list[int] = list(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced pages with a key, LRU first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        # Called with a page's key when the page is evicted and its name forgotten.
        self.on_forget: Callable[[bytes], None] | None = None

    @property
    def available(self) -> int:
        """Pages an allocation can take now (free plus evictable cached pages)."""
        return len(self._free) + len(self._cached)

    @property
    def cached_pages(self) -> int:
        return len(self._cached)

    def holds(self, key: bytes) -> bool:
        """Whether a page named ``key`` is known (in use or cached)."""
        return key in self._page_of

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Take a reference on the cached pages of the longest known prefix of ``keys``."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._retain(page)
        return pages

    def allocate(self, count: int) -> list[int]:
        if count > self.available:
            raise ContextOverflowError(
                f"the cache has {self.available} free pages of {self.page_size} tokens, {count} are needed"
            )
        pages = []
        for _ in range(count):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._cached.popitem(last=False)
                self._forget(page)
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def register(self, page: int, key: bytes) -> None:
        """Record that ``page`` now holds the full page named ``key``."""
        if not self.reuse_prefixes or page in self._key_of or key in self._page_of:
            return  # not reusing, already named, or another page holds the same content
        self._key_of[page] = key
        self._page_of[key] = page

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refcount[page] -= 1
            if self.refcount[page] > 0:
                continue
            if page in self._key_of:
                self._cached[page] = None
            else:
                heapq.heappush(self._free, page)

    def _retain(self, page: int) -> None:
        if self.refcount[page] == 0:
            self._cached.pop(page, None)
        self.refcount[page] += 1

    def clear_cached(self) -> None:
        """Forget every unreferenced cached page (e.g. after the model changed)."""
        while self._cached:
            page, _ = self._cached.popitem(last=False)
            self._forget(page)
            heapq.heappush(self._free, page)

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        if self.on_forget is not None:
            self.on_forget(key)
