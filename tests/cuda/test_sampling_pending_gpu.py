"""The pending token of ext/sampling.cu (a pipelined step's last token, still on the device, that
the packed penalty lists do not hold yet), in both kernels: the same ids as the lists packed with
the token appended (bit for bit: the same penalised logits, the same decision), and the torch
reference's decision with ``pending``; also under CUDA graph replay with new pending tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_helpers import capture

from engine.generation.sampling import Sampler, SamplingSettings, pack_rows, sample_reference
from engine.kernels import sampling as kernel_sampling

pytestmark = pytest.mark.cuda

KERNELS = ["cluster", "single"]  # sample_tokens' cluster=True / False
CLUSTER = 8  # blocks per row of the cluster kernel


@pytest.fixture(autouse=True)
def _need_extension(cuda_extension):
    if not hasattr(cuda_extension, "sample_tokens"):
        pytest.fail("the extension has no sample_tokens (ext/sampling.cu not built in)")


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param == "single":
        single = functools.partial(kernel_sampling.sample_tokens, cluster=False)
        monkeypatch.setattr(kernel_sampling, "sample_tokens", single)
    return request.param


def _pick(g: torch.Generator, options: list):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _batch(g: torch.Generator, rows: int, vocab: int):
    """Random settings (penalties mostly on), contexts, generated tokens and a pending token per
    row: already in the context, already generated, new (often at a cluster slice's edge, where
    the block owning it changes), absent or out of range."""
    slice_len = (vocab + CLUSTER - 1) // CLUSTER
    edges = [0, vocab - 1] + [min(vocab - 1, k * slice_len + d) for k in range(1, CLUSTER) for d in (-1, 0)]
    settings, prompts, generated, pending = [], [], [], []
    for _ in range(rows):
        settings.append(
            SamplingSettings(
                temperature=_pick(g, [0.0, 0.0, 0.7, 1.0]),
                top_k=_pick(g, [0, 0, 50]),
                top_p=_pick(g, [1.0, 0.9]),
                min_p=_pick(g, [0.0, 0.02]),
                repetition_penalty=_pick(g, [1.0, 1.5, 0.7, 3.0]),
                presence_penalty=_pick(g, [0.0, 0.8, -0.4]),
                frequency_penalty=_pick(g, [0.0, 0.5]),
            )
        )
        span = _pick(g, [vocab, min(vocab, 40)])
        prompt = torch.randint(0, span, (int(torch.randint(1, 2000, (1,), generator=g)),), generator=g)
        gen = torch.randint(0, span, (int(torch.randint(0, 500, (1,), generator=g)),), generator=g)
        prompts.append(prompt.tolist())
        generated.append(gen.tolist())
        kind = _pick(g, ["prompt", "generated", "new", "edge", "edge", "none", "out"])
        if kind == "prompt":
            p = _pick(g, prompts[-1])
        elif kind == "generated" and generated[-1]:
            p = _pick(g, generated[-1])
        elif kind == "edge":
            p = _pick(g, edges)
        elif kind == "none":
            p = -1
        elif kind == "out":
            p = vocab + 3
        else:
            p = int(torch.randint(0, vocab, (1,), generator=g))
        pending.append(p)
    return settings, prompts, generated, pending


def _pack(settings, prompts, generated, appended=None):
    contexts, gens = [], []
    for i, (s, prompt, gen) in enumerate(zip(settings, prompts, generated)):
        extra = [appended[i]] if appended is not None and appended[i] >= 0 else []
        contexts.append(Sampler(s).context_ids(prompt + gen + extra) if s.repetition_penalty != 1.0 else ())
        gens.append(gen + extra)
    return pack_rows(settings, contexts, gens).to("cuda")


def _logits(g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype, pending: list[int]):
    """Language-model-like rows whose pending token is often among the best (so its penalty
    decides the greedy rows)."""
    x = torch.randn(rows, vocab, generator=g) * 2.5
    for r in range(rows):
        top = torch.randint(0, vocab, (8,), generator=g)
        x[r, top] += torch.rand(8, generator=g) * 12
        if 0 <= pending[r] < vocab:
            x[r, pending[r]] = x[r].max() + 0.5
    return x.to(dtype).cuda()


@pytest.mark.parametrize("vocab", [5, 1000, 32001, 128256, 151936])
def test_pending_is_the_token_appended(vocab, kernel):
    g = torch.Generator().manual_seed(vocab + (kernel == "single"))
    differ = total = 0
    for batch in (1, 3, 8):
        for _ in range(4):
            settings, prompts, generated, pending = _batch(g, batch, vocab)
            logits = _logits(g, batch, vocab, _pick(g, [torch.float32, torch.bfloat16]), pending)
            in_range = [p if 0 <= p < vocab else -1 for p in pending]
            appended = _pack(settings, prompts, generated, in_range)
            without = _pack(settings, prompts, generated)
            p = torch.tensor(pending, dtype=torch.int64, device="cuda")
            u = torch.rand(batch, generator=g).cuda()
            got = kernel_sampling.sample_tokens(logits, without, u, pending=p)
            # The same penalised logits, the same deterministic decision: bit for bit.
            assert torch.equal(got, kernel_sampling.sample_tokens(logits, appended, u)), (settings, pending)
            want = sample_reference(logits, without, u, p)
            assert torch.equal(want, sample_reference(logits, appended, u))
            greedy = torch.tensor([s.is_greedy for s in settings], device="cuda")
            assert torch.equal(got[greedy], want[greedy])  # an argmax has no rounding boundary
            differ += int((got != want).sum())
            total += batch
    assert differ <= max(1, total // 50)  # sampled rows: a draw may sit on a rounding boundary


def test_both_kernels_agree_with_pending():
    g = torch.Generator().manual_seed(77)
    for vocab in (1000, 128257, 262144):
        settings, prompts, generated, pending = _batch(g, 8, vocab)
        logits = _logits(g, 8, vocab, torch.bfloat16, pending)
        rows = _pack(settings, prompts, generated)
        p = torch.tensor(pending, dtype=torch.int64, device="cuda")
        u = torch.rand(8, generator=g).cuda()
        cluster = kernel_sampling.sample_tokens(logits, rows, u, pending=p)
        single = kernel_sampling.sample_tokens(logits, rows, u, pending=p, cluster=False)
        assert torch.equal(cluster, single), (vocab, cluster.tolist(), single.tolist())


def test_pending_alone_opens_the_penalty_gate(kernel):
    # Empty lists: only the pending token is penalised (greedy rows, so the answer is exact).
    vocab = 151936
    logits = torch.zeros(3, vocab)
    logits[:, 1234] = 5.0
    logits[:, 99999] = 4.9
    logits = logits.cuda()
    settings = [
        SamplingSettings(temperature=0.0, repetition_penalty=10.0),
        SamplingSettings(temperature=0.0, presence_penalty=1.0),
        SamplingSettings(temperature=0.0, frequency_penalty=1.0),
    ]
    rows = pack_rows(settings, [[]] * 3, [[]] * 3).to("cuda")
    u = torch.zeros(3, device="cuda")
    assert kernel_sampling.sample_tokens(logits, rows, u).tolist() == [1234] * 3
    p = torch.full((3,), 1234, dtype=torch.int64, device="cuda")
    assert kernel_sampling.sample_tokens(logits, rows, u, pending=p).tolist() == [99999] * 3
    p.fill_(-1)
    assert kernel_sampling.sample_tokens(logits, rows, u, pending=p).tolist() == [1234] * 3


def test_graph_replay_with_new_pending_tokens(kernel):
    g = torch.Generator().manual_seed(5)
    vocab = 128256
    settings, prompts, generated, pending = _batch(g, 8, vocab)
    logits = _logits(g, 8, vocab, torch.bfloat16, pending)
    rows = _pack(settings, prompts, generated)
    u = torch.rand(8, generator=g).cuda()
    p = torch.tensor(pending, dtype=torch.int64, device="cuda")
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    graph, _ = capture(lambda: kernel_sampling.sample_tokens(logits, rows, u, out, pending=p))
    for _ in range(8):
        p.copy_(torch.randint(-1, vocab, (8,), generator=g))
        u.copy_(torch.rand(8, generator=g))
        graph.replay()
        assert torch.equal(out, kernel_sampling.sample_tokens(logits, rows, u, pending=p))
