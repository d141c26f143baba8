"""Learned attention sinks (gpt-oss) in every torch attention path: the prompt path (``attend``),
the CPU decode over cache runs (``attend_one``) and the paged decode reference, dense or
quantized cache; each against a plain definition: a softmax over the scores and one more logit
per head, whose weight is dropped. Also that the GPU kernel's wrapper hands the sinks to the
kernel (a stand-in extension here; the kernel's numbers: tests/cuda/test_paged_attention.py)."""

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


def test_a_prompt_with_sinks_never_forms_the_score_matrix(monkeypatch) -> None:
    """Prompts with sinks go through SDPA with the sink as one more key: the explicit softmax
    (a [heads, n, L] float32 tensor, 4 GiB a layer for a 4K gpt-oss prompt) is not used."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the prompt path formed the scores")

    monkeypatch.setattr("engine.modules.attention.softmax_with_sinks", refuse)
    q, k, v, sinks = _qkv(9, 9, seed=3)
    positions = torch.arange(9)
    got = attend(q, k, v, positions, positions, D**-0.5, 4, sinks=sinks)
    torch.testing.assert_close(got, _definition(q, k, v, positions, positions, D**-0.5, 4, sinks))


def test_the_sink_logit_keeps_float32_precision_in_bfloat16() -> None:
    """Zero queries see every key at logit 0, so with values of one the output is
    ``L / (L + exp(sink))`` exactly. The sinks over the scale (34.2 and 38.3 here) fall between
    bfloat16 steps of 0.25, 2.5% of a logit unit after scaling back; carried as a high and a low
    bfloat16 part they still arrive to float32 precision, and the output is right to bfloat16's
    own rounding."""
    length, scale = 1000, 0.3
    sinks = torch.tensor([10.25, 11.5])
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(length, 2, 16).to(torch.bfloat16)
    v = torch.ones(length, 2, 16, dtype=torch.bfloat16)
    positions = torch.arange(length)
    got = attend(q, k, v, positions[-1:], positions, scale, sinks=sinks)
    exact = length / (length + torch.exp(sinks.double()))
    torch.testing.assert_close(got[0, :, 0].double(), exact, rtol=2**-7, atol=0)


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


KERNEL_D = 64  # a head size the kernel is built for


class _DenseSides:
    """A dense cache layer as the kernel's binding sees it: keys and values read by slot."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def read(self, slots: torch.Tensor):
        return self.keys[slots], self.values[slots]


class _StandInExtension:
    """The binding ``paged_decode_attention`` in torch: the reference over its dense sides, with
    whatever ``sinks`` the wrapper passed (the kernel's numbers are tested in tests/cuda)."""

    def __init__(self) -> None:
        self.sinks_passed: list[torch.Tensor | None] = []

    def paged_decode_attention(
        self,
        q,
        k_dense,
        k_codes,
        k_scales,
        k_bits,
        v_dense,
        v_codes,
        v_scales,
        v_bits,
        tables,
        lengths,
        page,
        scale,
        window,
        softcap,
        tensor_cores=True,
        sinks=None,
    ):
        assert k_bits == v_bits == 16 and tables.dtype == lengths.dtype == torch.int32
        self.sinks_passed.append(sinks)
        return paged_decode_attention_reference(
            q,
            _DenseSides(k_dense, v_dense),
            tables,
            lengths,
            page,
            scale,
            window or None,
            softcap or None,
            sinks,
        )


def _kernel_case(monkeypatch, dtype=torch.float16):
    """A dense one-layer cache on the CPU with the stand-in extension and the dense sides the
    wrapper reads off it (its own ``cache_side`` takes only CUDA tensors)."""
    from engine.kernels import attention as kernel_attention
    from engine.kernels import loader

    ext = _StandInExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: ext)
    monkeypatch.setattr(
        kernel_attention, "cache_side", lambda store, q: (store.data.shape[1], store.data, None, None, 16)
    )
    page, lengths = 4, [1, 6, 13, 12]  # the last two: verify rows of one sequence
    g = torch.Generator().manual_seed(5)
    cache = PagedKVCache(1, KV_HEADS, KERNEL_D, 16, page, dtype, "cpu")
    layer = cache.layer(0)
    shape = (cache.capacity, KV_HEADS, KERNEL_D)
    layer.write(
        torch.arange(cache.capacity),
        torch.randn(shape, generator=g).to(dtype),
        torch.randn(shape, generator=g).to(dtype),
    )
    tables = torch.randperm(16, generator=g)[:16].view(4, 4)
    tables[3] = tables[2]
    q = torch.randn(len(lengths), HEADS, KERNEL_D, generator=g).to(dtype)
    sinks = torch.randn(HEADS, generator=g) * 3.0
    return ext, (q, layer, tables, torch.tensor(lengths), page, KERNEL_D**-0.5), sinks


@pytest.mark.parametrize("window", [None, 5])
def test_the_gpu_kernel_takes_the_sinks(monkeypatch, window) -> None:
    """With sinks the decode entry point runs the kernel (no longer the reference), handing it
    the layer's per-head logits as fp32 [heads] (bf16 ones converted), and None without."""
    ext, (q, layer, tables, lengths, page, scale), sinks = _kernel_case(monkeypatch)
    args = (q, layer, tables, lengths, page, scale, window, None)
    got = paged_decode_attention(*args, sinks=sinks)
    (passed,) = ext.sinks_passed
    assert passed.dtype == torch.float32 and passed.is_contiguous() and torch.equal(passed, sinks)
    assert torch.equal(got, paged_decode_attention_reference(*args, sinks))
    assert (got.float() - paged_decode_attention_reference(*args).float()).abs().max() > 1e-2
    paged_decode_attention(*args, sinks=sinks.to(torch.bfloat16))
    assert ext.sinks_passed[-1].dtype == torch.float32
    assert torch.equal(ext.sinks_passed[-1], sinks.to(torch.bfloat16).float())
    paged_decode_attention(*args)
    assert ext.sinks_passed[-1] is None


def test_sinks_of_the_wrong_shape_are_refused(monkeypatch) -> None:
    from engine.kernels import attention as kernel_attention

    ext, (q, layer, tables, lengths, page, scale), sinks = _kernel_case(monkeypatch)
    for bad in (sinks[:-1], sinks[None, :]):
        with pytest.raises(ValueError, match="one logit per head"):
            kernel_attention.paged_decode_attention(
                q, layer, tables, lengths, page, scale, None, None, sinks=bad
            )
    assert ext.sinks_passed == []
