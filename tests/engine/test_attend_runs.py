"""A CPU decode step reads the paged cache in place: runs of consecutive slots as views
(``KVCacheLayer.read_runs``) and attention over the runs (``attend_one``), equal to gathering the
keys and running the reference ``attend``."""

from __future__ import annotations

import pytest
import torch

from engine.cache.paged import PagedKVCache
from engine.modules.attention import attend, attend_one


def _cache(kbits: int = 16, vbits: int = 16, kv_heads: int = 2, head_dim: int = 32) -> PagedKVCache:
    cache = PagedKVCache(1, kv_heads, head_dim, 8, 4, torch.float32, "cpu", (kbits, vbits))
    g = torch.Generator().manual_seed(kbits + vbits)
    shape = (cache.capacity, kv_heads, head_dim)
    cache.layer(0).write(
        torch.arange(cache.capacity), torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    )
    return cache


def test_runs_are_views_of_consecutive_slots() -> None:
    layer = _cache().layer(0)
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 20, 21])  # pages 2, 0 (part) and 5 (part)
    runs = layer.read_runs(slots)
    assert [k.shape[0] for k, _ in runs] == [4, 3, 2]
    assert runs[0][0].data_ptr() == layer.keys.data[8].data_ptr()  # no copy
    keys, values = layer.read(slots)
    assert torch.equal(torch.cat([k for k, _ in runs]), keys)
    assert torch.equal(torch.cat([v for _, v in runs]), values)
    assert len(layer.read_runs(torch.arange(3, 17))) == 1
    # A quantized side is dequantized by read(); no views of it exist.
    assert _cache(kbits=4).layer(0).read_runs(slots) is None


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_attend_one_equals_attend_over_the_gathered_keys(heads, kv_heads, softcap) -> None:
    layer = _cache(kv_heads=kv_heads).layer(0)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7, 28, 29, 30])
    q = torch.randn(1, heads, 32, generator=torch.Generator().manual_seed(heads))
    keys, values = layer.read(slots)
    n = slots.numel()
    want = attend(q, keys, values, torch.tensor([n - 1]), torch.arange(n), 0.2, None, softcap)
    got = attend_one(q, layer.read_runs(slots), 0.2, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
