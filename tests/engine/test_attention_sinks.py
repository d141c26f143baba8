"""Learned attention sinks (gpt-oss) in every torch attention path: the prompt path (``attend``),
the CPU decode over cache runs (``attend_one``) and the paged decode reference, dense or
quantized cache; each against a plain definition: a softmax over the scores and one more logit
per head, whose weight is dropped."""

from __future__ import annotations

import pytest
import torch

from engine.cache.decode_attention import paged_decode_attention, paged_decode_attention_reference
from engine.cache.paged import PagedKVCache
from engine.modules.attention import attend, attend_one
from engine.modules.attention_sinks import softmax_with_sinks

HEADS, KV_HEADS, D = 4, 2, 16


def _definition(q, k, v, q_pos, k_pos, scale, window, sinks) -> torch.Tensor:
    """Attention with sinks, written out: scores of every head, the sink appended as one more
    column, softmax, the sink's column dropped. ``q`` [n, heads, d], ``k``/``v`` [L, kv, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", weights, v).float()


def _qkv(n: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, D, generator=g)
    k, v = torch.randn(length, KV_HEADS, D, generator=g), torch.randn(length, KV_HEADS, D, generator=g)
    sinks = torch.randn(HEADS, generator=g) * 3.0
    return q, k, v, sinks


def test_a_sink_is_one_more_logit_without_a_value() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 5, 7, generator=g) * 4
    sinks = torch.randn(3, generator=g) * 4
    scores[0, 1, 2:] = float("-inf")
    expected = torch.softmax(torch.cat([scores, sinks[:, None, None].expand(3, 5, 1)], -1), -1)[..., :-1]
    got = softmax_with_sinks(scores, sinks[:, None])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert (got.sum(-1) < 1).all()  # the sink takes its share
    # A row with every key masked attends to nothing (no NaN); a huge sink still cannot overflow.
    masked = softmax_with_sinks(torch.full((2, 4), float("-inf")), torch.tensor([0.0, 500.0]))
    assert torch.equal(masked, torch.zeros(2, 4))
    assert torch.isfinite(softmax_with_sinks(torch.randn(2, 4), torch.tensor([800.0, -800.0]))).all()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("n,past", [(12, 0), (4, 9), (1, 20)])
def test_attend_with_sinks_matches_the_definition(window, n, past) -> None:
    """A prompt from position 0, a chunk continuing one, and one query (a decode step handed only
    the keys in its window, as the attention module does)."""
    q, k, v, sinks = _qkv(n, past + n, seed=n + past)
    q_pos, k_pos = torch.arange(past, past + n), torch.arange(past + n)
    if n == 1 and window is not None:
        k, v, k_pos = k[-window:], v[-window:], k_pos[-window:]
    scale = D**-0.5
    got = attend(q, k, v, q_pos, k_pos, scale, window, sinks=sinks)
    want = _definition(q, k, v, q_pos, k_pos, scale, window, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    without = attend(q, k, v, q_pos, k_pos, scale, window)
    assert (got - without).abs().max() > 1e-2  # the sinks change the result


def test_attend_one_over_cache_runs_applies_the_sinks() -> None:
    """The CPU decode step reads the cache as runs of consecutive slots; the softmax, sink
    included, spans all of them (query heads grouped per KV head)."""
    q, k, v, sinks = _qkv(1, 23, seed=3)
    runs = [(k[:8], v[:8]), (k[8:9], v[8:9]), (k[9:], v[9:])]
    got = attend_one(q, runs, D**-0.5, sinks=sinks)
    want = _definition(q, k, v, torch.tensor([22]), torch.arange(23), D**-0.5, None, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [(16, 16), (8, 8), (4, 6)])
@pytest.mark.parametrize("window", [None, 6])
def test_the_paged_decode_reference_applies_the_sinks(bits, window) -> None:
    """Batched decode from a paged cache, dense or quantized: each sequence's output is the
    definition over the keys and values the cache gives back."""
    page, lengths = 4, [1, 7, 13]
    g = torch.Generator().manual_seed(sum(bits))
    cache = PagedKVCache(1, KV_HEADS, D, 16, page, torch.float32, "cpu", bits)
    layer = cache.layer(0)
    shape = (cache.capacity, KV_HEADS, D)
    layer.write(
        torch.arange(cache.capacity), torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    )
    tables = torch.randperm(16, generator=g)[:12].view(3, 4)
    q = torch.randn(len(lengths), HEADS, D, generator=g)
    sinks = torch.randn(HEADS, generator=g) * 3.0
    scale = D**-0.5
    args = (q, layer, tables, torch.tensor(lengths), page, scale, window, None)
    got = paged_decode_attention_reference(*args, sinks)
    assert torch.equal(paged_decode_attention(*args, sinks=sinks), got)  # on the CPU: the reference
    for b, n in enumerate(lengths):
        keys, values = layer.read(cache.slots(tables[b].tolist(), 0, n))
        want = _definition(
            q[b : b + 1], keys, values, torch.tensor([n - 1]), torch.arange(n), scale, window, sinks
        )
        torch.testing.assert_close(got[b : b + 1], want, rtol=1e-5, atol=1e-5)


def test_the_gpu_kernel_is_never_asked_to_attend_with_sinks(monkeypatch) -> None:
    """The paged decode kernel has no sink term: with sinks its wrapper declines before calling
    it, even where the extension is there, so the reference runs (correct on any device)."""
    from engine.kernels import attention as kernel_attention
    from engine.kernels import loader

    class Extension:
        calls = 0

        def paged_decode_attention(self, *args, **kwargs):
            Extension.calls += 1
            raise AssertionError("the kernel was called for a layer with sinks")

    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: Extension())
    q = torch.zeros(1, HEADS, D, dtype=torch.float16)
    args = (q, None, torch.zeros(1, 1), torch.ones(1), 4, 1.0, None, None)
    assert kernel_attention.paged_decode_attention(*args, sinks=torch.zeros(HEADS)) is None
    assert Extension.calls == 0
