"""The paged decode-attention reference equals per-sequence attention over the cache it reads.

``engine.cache.decode_attention.paged_decode_attention_reference`` is what the CUDA kernel is
tested against (tests/cuda/test_paged_attention.py), so it is checked here, on the CPU, against
the module library's ``attend`` run sequence by sequence on exactly the keys each query sees.
"""

from __future__ import annotations

import pytest
import torch

from engine.cache.decode_attention import paged_decode_attention, paged_decode_attention_reference
from engine.cache.paged import PagedKVCache
from engine.modules.attention import attend

PAGE = 4


def _filled_cache(kbits: int, vbits: int, kv_heads: int, head_dim: int, lengths: list[int], seed: int):
    """A one-layer cache with random keys/values in every slot, and a random, non-contiguous page table."""
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // PAGE) for n in lengths) + 1  # one padding page more than the longest needs
    num_pages = len(lengths) * max_pages + 3
    cache = PagedKVCache(1, kv_heads, head_dim, num_pages, PAGE, torch.float32, "cpu", (kbits, vbits))
    layer = cache.layer(0)
    everything = torch.arange(cache.capacity)
    shape = (cache.capacity, kv_heads, head_dim)
    layer.write(everything, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    tables = torch.randperm(num_pages, generator=g)[: len(lengths) * max_pages].view(len(lengths), max_pages)
    return cache, layer, tables, g


def _per_sequence(q, cache, layer, tables, lengths, scale, window, softcap):
    outs = []
    for b, n in enumerate(lengths):
        lo = max(0, n - window) if window else 0
        keys, values = layer.read(cache.slots(tables[b].tolist(), lo, n))
        out = attend(
            q[b : b + 1], keys, values, torch.tensor([n - 1]), torch.arange(lo, n), scale, window, softcap
        )
        outs.append(out[0])
    return torch.stack(outs)


@pytest.mark.parametrize("kbits,vbits", [(16, 16), (4, 4), (8, 4), (3, 6), (16, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (7, 20.0)])
def test_reference_equals_attend_over_the_read_cache(kbits, vbits, window, softcap):
    lengths = [1, PAGE, PAGE + 1, 13, 2]
    kv_heads, heads, head_dim = 2, 8, 64  # GQA: 4 query heads per kv head
    cache, layer, tables, g = _filled_cache(
        kbits, vbits, kv_heads, head_dim, lengths, seed=kbits * 100 + vbits
    )
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    got = paged_decode_attention_reference(
        q, layer, tables, torch.tensor(lengths), PAGE, scale, window, softcap
    )
    want = _per_sequence(q, cache, layer, tables, lengths, scale, window, softcap)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])
def test_reference_gqa_ratios(heads, kv_heads):
    lengths = [9, 1, 16]
    cache, layer, tables, g = _filled_cache(16, 16, kv_heads, 32, lengths, seed=heads)
    q = torch.randn(len(lengths), heads, 32, generator=g)
    got = paged_decode_attention_reference(q, layer, tables, torch.tensor(lengths), PAGE, 0.3, None, None)
    want = _per_sequence(q, cache, layer, tables, lengths, 0.3, None, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_reference_ignores_what_lies_past_each_length():
    """Changing keys at or past a sequence's length (or outside its window) changes nothing."""
    lengths = [6, 3]
    cache, layer, tables, g = _filled_cache(4, 4, 2, 64, lengths, seed=7)
    q = torch.randn(2, 4, 64, generator=g)
    before = paged_decode_attention_reference(q, layer, tables, torch.tensor(lengths), PAGE, 0.125, 4, None)
    junk = torch.cat(
        [
            cache.slots(tables[0].tolist(), 6, 8),
            cache.slots(tables[0].tolist(), 0, 2),
            cache.slots(tables[1].tolist(), 3, 8),
        ]
    )
    shape = (len(junk), 2, 64)
    layer.write(junk, 50 * torch.randn(shape, generator=g), 50 * torch.randn(shape, generator=g))
    after = paged_decode_attention_reference(q, layer, tables, torch.tensor(lengths), PAGE, 0.125, 4, None)
    torch.testing.assert_close(after, before)


def test_dispatch_falls_back_to_the_reference_on_the_cpu():
    lengths = [5, 2]
    cache, layer, tables, g = _filled_cache(4, 16, 2, 64, lengths, seed=3)
    q = torch.randn(2, 4, 64, generator=g)
    args = (q, layer, tables, torch.tensor(lengths), PAGE, 0.125, None, None)
    torch.testing.assert_close(paged_decode_attention(*args), paged_decode_attention_reference(*args))


class _RecordingExtension:
    """Stands in for the CUDA extension: records the head size of each decode-attention call and
    answers zeros (the kernel's numbers: tests/cuda/test_paged_attention.py)."""

    def __init__(self) -> None:
        self.head_dims: list[int] = []

    def paged_decode_attention(self, q, *args, **kwargs):
        self.head_dims.append(q.shape[-1])
        return torch.zeros_like(q)


@pytest.mark.parametrize(
    "head_dim,built", [(64, True), (128, True), (256, True), (512, True), (96, False), (320, False)]
)
def test_the_kernel_wrapper_takes_the_head_sizes_the_kernel_is_built_for(monkeypatch, head_dim, built):
    """Every head size the kernel is instantiated for reaches it, Gemma 4's full layers (512, 8
    query heads a kv head) included; other sizes stay on the torch path (the wrapper answers None)."""
    from engine.kernels import attention as kernel_attention
    from engine.kernels import loader

    ext = _RecordingExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: ext)
    monkeypatch.setattr(  # the wrapper's own reading of a store takes only CUDA tensors
        kernel_attention, "cache_side", lambda store, q: (store.data.shape[1], store.data, None, None, 16)
    )
    lengths = [5, 2]
    _, layer, tables, g = _filled_cache(16, 16, 1, head_dim, lengths, seed=head_dim)
    q = torch.randn(len(lengths), 8, head_dim, generator=g).half()
    got = kernel_attention.paged_decode_attention(
        q, layer, tables, torch.tensor(lengths), PAGE, head_dim**-0.5, None, None
    )
    assert (got is not None) == built == (head_dim in kernel_attention.PAGED_HEAD_DIMS)
    assert ext.head_dims == ([head_dim] if built else [])
