import pytest

from engine.cache.pages import PageAllocator, page_keys
from engine.errors import ContextOverflowError


def test_page_keys_chain_over_the_prefix():
    a = page_keys([1, 2, 3, 4, 5, 6, 7], 3)
    b = page_keys([1, 2, 3, 4, 5, 6, 9, 9], 3)
    c = page_keys([0, 2, 3, 4, 5, 6], 3)
    assert len(a) == 2  # the partial page has no key
    assert a == b[:2]
    assert a[1] != c[1]  # same tokens, different history: different key


def test_release_keeps_named_pages_for_reuse():
    alloc = PageAllocator(4, 2)
    pages = alloc.allocate(2)
    keys = page_keys([1, 2, 3, 4], 2)
    for p, k in zip(pages, keys):
        alloc.register(p, k)
    alloc.release(pages)
    assert alloc.cached_pages == 2 and alloc.available == 4
    assert alloc.match_prefix(keys) == pages
    assert alloc.cached_pages == 0


def test_eviction_only_when_free_pages_run_out():
    alloc = PageAllocator(3, 2)
    (p,) = alloc.allocate(1)
    key = page_keys([7, 7], 2)[0]
    alloc.register(p, key)
    alloc.release([p])
    alloc.allocate(2)  # two never-used pages: the cached one survives
    assert alloc.match_prefix([key]) == [p]
    alloc.release([p])
    alloc.allocate(1)  # now it must be evicted
    assert alloc.match_prefix([key]) == []


def test_allocation_beyond_capacity_is_a_clear_error():
    alloc = PageAllocator(2, 16)
    alloc.allocate(1)
    with pytest.raises(ContextOverflowError, match="1 free pages"):
        alloc.allocate(2)


def test_page_keys_continue_from_a_known_key():
    tokens = list(range(40))
    whole = page_keys(tokens, 8)
    assert page_keys(tokens[16:], 8, previous=whole[1]) == whole[2:]


def test_allocation_takes_the_lowest_free_pages():
    # Released pages come back in page order, whatever order they were freed in: a sequence's
    # pages stay consecutive where they can (the CPU reads runs of them in place).
    alloc = PageAllocator(8, 2)
    first = alloc.allocate(5)
    assert first == [0, 1, 2, 3, 4]
    alloc.release([3, 1, 4])
    assert alloc.allocate(4) == [1, 3, 4, 5]
