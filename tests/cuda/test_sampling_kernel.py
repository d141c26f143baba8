"""The GPU sampler (ext/sampling.cu) against the one sampling reference
(engine.generation.sampling.sample_reference, the CPU path too) run on the same GPU: the same token
for the same uniform, every setting alone and combined."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cuda_helpers import capture

from engine.generation.sampling import Sampler, SamplingRows, SamplingSettings, pack_rows, sample_reference
from engine.kernels import sampling as kernel_sampling

pytestmark = pytest.mark.cuda

VOCABS = [32000, 128256, 151936, 262144]

SETTINGS = [
    SamplingSettings.greedy(),
    SamplingSettings(temperature=1.0),
    SamplingSettings(temperature=0.6),
    SamplingSettings(temperature=1.0, top_k=1),
    SamplingSettings(temperature=1.0, top_k=40),
    SamplingSettings(temperature=1.0, top_k=1000),
    SamplingSettings(temperature=1.0, top_p=0.9),
    SamplingSettings(temperature=1.0, top_p=0.5),
    SamplingSettings(temperature=1.0, min_p=0.05),
    SamplingSettings(temperature=1.0, repetition_penalty=1.3),
    SamplingSettings(temperature=1.0, presence_penalty=0.7),
    SamplingSettings(temperature=1.0, frequency_penalty=0.4),
    SamplingSettings(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingSettings(temperature=0.8, top_k=200, top_p=0.95, min_p=0.02),
    SamplingSettings(
        temperature=0.7,
        top_k=64,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
    ),
    SamplingSettings(
        temperature=1.3, top_p=0.99, min_p=0.001, repetition_penalty=0.9, frequency_penalty=-0.2
    ),
]


@pytest.fixture(autouse=True)
def _need_extension(cuda_extension):
    if not hasattr(cuda_extension, "sample_tokens"):
        pytest.fail("the extension has no sample_tokens (ext/sampling.cu not built in)")


def _pick(g: torch.Generator, options: list):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _logits(g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Language-model-like rows: a broad random body and a few strong candidates."""
    x = torch.randn(rows, vocab, generator=g) * 2.5
    for r in range(rows):
        top = torch.randint(0, vocab, (8,), generator=g)
        x[r, top] += torch.rand(8, generator=g) * 12
    return x.to(dtype).cuda()


def _rows(g: torch.Generator, settings: list[SamplingSettings], vocab: int) -> SamplingRows:
    contexts, generated = [], []
    for _ in settings:
        n = int(torch.randint(0, 3000, (1,), generator=g))
        ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
        contexts.append(sorted(set(ctx)))
        generated.append(ctx[n // 2 :])
    return pack_rows(settings, contexts, generated).to("cuda")


def _nudged(
    rows: SamplingRows, u: torch.Tensor, eps: float = 1e-4
) -> list[tuple[SamplingRows, torch.Tensor]]:
    """The inputs with u, top_p and min_p nudged by a relative eps (a decision that changes under
    these sits on a float-rounding boundary)."""
    out = [(rows, (u * (1 + eps)).clamp(max=0.9999999)), (rows, u * (1 - eps))]
    for col, cap in ((2, 1.0), (3, 0.99)):
        for f in (1 + eps, 1 - eps):
            s = rows.settings.clone()
            active = s[:, col] < 1.0 if col == 2 else s[:, col] > 0
            s[:, col] = torch.where(active, (s[:, col] * f).clamp(max=cap), s[:, col])
            out.append((dataclasses.replace(rows, settings=s), u))
    return out


def _check(logits: torch.Tensor, rows: SamplingRows, u: torch.Tensor) -> int:
    """Kernel vs reference on one batch; returns how many rows differed (each only at a rounding
    boundary, else the assertion fails)."""
    got = kernel_sampling.sample_tokens(logits, rows, u)
    want = sample_reference(logits, rows, u)
    assert got.dtype == torch.int64 and got.device == logits.device
    # A drawn id must exist (a wrong draw can point past the kept tokens).
    assert bool(((got >= 0) & (got < logits.shape[1])).all()), got.tolist()
    differ = (got != want).nonzero().squeeze(1).tolist()
    if differ:
        alternatives = [sample_reference(logits, r, v) for r, v in _nudged(rows, u)]
        for i in differ:
            assert int(got[i]) in {int(a[i]) for a in alternatives}, (
                i,
                rows.settings[i].tolist(),
                float(u[i]),
            )
    return len(differ)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_setting_alone_matches_the_reference(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    differ = total = 0
    for batch, start in [(1, 0), (8, 0), (8, 8), (5, 3)]:
        settings = [SETTINGS[(start + r) % len(SETTINGS)] for r in range(batch)]
        logits = _logits(g, batch, vocab, dtype)
        rows = _rows(g, settings, vocab)
        for _ in range(12):
            u = torch.rand(batch, generator=g).cuda()
            differ += _check(logits, rows, u)
            total += batch
    assert differ <= total // 100


@pytest.mark.parametrize("batch", range(1, 9))
def test_random_combined_settings_and_batches(batch):
    g = torch.Generator().manual_seed(100 + batch)
    differ = total = 0
    for vocab in VOCABS:
        settings = []
        for _ in range(batch):
            settings.append(
                SamplingSettings(
                    temperature=_pick(g, [0.0, 0.5, 0.8, 1.0, 1.5]),
                    top_k=_pick(g, [0, 0, 1, 20, 500, vocab, vocab + 1]),
                    top_p=_pick(g, [1.0, 0.3, 0.8, 0.95]),
                    min_p=_pick(g, [0.0, 0.01, 0.1]),
                    repetition_penalty=_pick(g, [1.0, 1.2, 0.85]),
                    presence_penalty=_pick(g, [0.0, 0.4]),
                    frequency_penalty=_pick(g, [0.0, 0.25]),
                )
            )
        logits = _logits(g, batch, vocab, _pick(g, [torch.float32, torch.bfloat16, torch.float16]))
        rows = _rows(g, settings, vocab)
        for _ in range(8):
            u = torch.rand(batch, generator=g).cuda()
            differ += _check(logits, rows, u)
            total += batch
    assert differ <= max(1, total // 100)


def test_ties_follow_the_documented_rule():
    # bf16 logits of a narrow range: hundreds of exact ties at every boundary.
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 32000, generator=g) * 0.5).to(torch.bfloat16).cuda()
    settings = [
        SamplingSettings(temperature=1.0, top_k=50),
        SamplingSettings(temperature=1.0, top_p=0.3),
        SamplingSettings(temperature=0.9, top_k=300, top_p=0.5),
        SamplingSettings(temperature=1.0, min_p=0.6),
    ]
    rows = pack_rows(settings, [[]] * 4, [[]] * 4).to("cuda")
    for _ in range(20):
        u = torch.rand(4, generator=g).cuda()
        assert torch.equal(kernel_sampling.sample_tokens(logits, rows, u), sample_reference(logits, rows, u))
    # Top-k 2 over [3, 2, 2, 2, 1, ...]: the three tied tokens all stay.
    x = torch.full((1, 1000), -5.0)
    x[0, :5] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    rows = pack_rows([SamplingSettings(temperature=1.0, top_k=2)], [[]], [[]]).to("cuda")
    drawn = {
        int(kernel_sampling.sample_tokens(x.cuda(), rows, torch.tensor([u], device="cuda"))[0])
        for u in torch.linspace(0, 0.999, 300).tolist()
    }
    assert drawn == {0, 1, 2, 3}


def test_the_host_sampler_takes_the_same_decision():
    g = torch.Generator().manual_seed(3)
    logits = _logits(g, 1, 128256, torch.float32)
    context = torch.randint(0, 128256, (500,), generator=g).tolist()
    same = 0
    for s in SETTINGS:
        for _ in range(5):
            u = float(torch.rand(1, generator=g))
            rows = pack_rows([s], [sorted(set(context))], [context[250:]]).to("cuda")
            device = int(kernel_sampling.sample_tokens(logits, rows, torch.tensor([u], device="cuda"))[0])
            host = Sampler(dataclasses.replace(s, seed=0)).sample(
                logits[0].cpu(), context, context[250:], u=u
            )
            same += device == host
    # The host runs the same reference on the CPU: only exp's rounding (CPU vs GPU) can move a
    # boundary, rarely.
    assert same >= 5 * len(SETTINGS) - 2


def test_int32_output_and_strided_rows():
    g = torch.Generator().manual_seed(5)
    big = _logits(g, 3, 2 * 32000, torch.float32)
    logits = big[:, :32000]  # row stride 64000
    rows = pack_rows(SETTINGS[4:7], [[]] * 3, [[]] * 3).to("cuda")
    u = torch.rand(3, generator=g).cuda()
    out = torch.empty(3, dtype=torch.int32, device="cuda")
    assert kernel_sampling.sample_tokens(logits, rows, u, out) is out
    assert out.tolist() == sample_reference(logits, rows, u).tolist()


def test_graph_capture_and_replay_give_the_same_ids():
    g = torch.Generator().manual_seed(11)
    vocab = 151936
    logits = _logits(g, 8, vocab, torch.bfloat16)
    rows = _rows(g, SETTINGS[-8:], vocab)
    u = torch.rand(8, generator=g).cuda()
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    graph, _ = capture(lambda: kernel_sampling.sample_tokens(logits, rows, u, out))
    for _ in range(10):
        # New inputs written in place, as a decode step does before replaying.
        logits.copy_(_logits(g, 8, vocab, torch.bfloat16))
        u.copy_(torch.rand(8, generator=g))
        settings = rows.settings.clone()
        settings[:, 0] = torch.rand(8, generator=g).cuda() + 0.3  # new temperatures
        rows.settings.copy_(settings)
        graph.replay()
        eager = kernel_sampling.sample_tokens(logits, rows, u)
        assert torch.equal(out, eager)  # integer weights: deterministic
        assert torch.equal(out, sample_reference(logits, rows, u)) or _check(logits, rows, u) <= 1


# The cluster kernel (sm_90+: a row over 8 blocks, each owning a slice of the vocabulary) and the
# single-block kernel (sm_80-89, larger vocabularies, ``cluster=False``) must take
# the same decision bit for bit: the same integer weights, the same thresholds, the same draw.
# Vocabularies: fewer tokens than blocks, not a multiple of the 8 slices, the largest common ones,
# and one above what a cluster's shared memory holds (the fallback path on every GPU).
@pytest.mark.parametrize("vocab", [5, 1000, 32001, 128256, 128257, 151936, 262144, 400003])
def test_cluster_and_single_block_kernels_agree_bit_for_bit(vocab):
    g = torch.Generator().manual_seed(200 + vocab)
    for batch in range(1, 9):
        settings = [SETTINGS[(batch + r) % len(SETTINGS)] for r in range(batch)]
        logits = _logits(g, batch, vocab, _pick(g, [torch.float32, torch.bfloat16, torch.float16]))
        rows = _rows(g, settings, vocab)
        u = torch.rand(batch, generator=g).cuda()
        cluster = kernel_sampling.sample_tokens(logits, rows, u)
        single = kernel_sampling.sample_tokens(logits, rows, u, cluster=False)
        assert torch.equal(cluster, single), (batch, cluster.tolist(), single.tolist())
        _check(logits, rows, u)


def test_flat_rows_and_masked_slices():
    # Every logit equal (each token weighs 2^44: the largest sums; with min-p every token is a
    # top-p candidate, more than the cluster kernel's candidate lists hold), and rows where whole
    # blocks' slices are -inf (their blocks contribute nothing to any search or to the draw).
    vocab = 128256
    flat = torch.zeros(3, vocab)
    masked = torch.full((2, vocab), float("-inf"))
    masked[0, 100_000:100_010] = torch.arange(10, dtype=torch.float32)
    masked[1, 5] = 1.0
    masked[1, vocab - 1] = 1.0
    logits = torch.cat([flat, masked]).cuda()
    settings = [
        SamplingSettings(temperature=1.0, top_k=1000),
        SamplingSettings(temperature=1.0, top_p=0.5),
        SamplingSettings(temperature=1.0, top_p=0.9, min_p=0.5),
        SamplingSettings(temperature=0.7, top_p=0.95, min_p=0.05),
        SamplingSettings(temperature=1.0),
    ]
    rows = pack_rows(settings, [[]] * 5, [[]] * 5).to("cuda")
    g = torch.Generator().manual_seed(13)
    for _ in range(20):
        u = torch.rand(5, generator=g).cuda()
        got = kernel_sampling.sample_tokens(logits, rows, u)
        assert torch.equal(got, sample_reference(logits, rows, u))
        assert 100_000 <= int(got[3]) < 100_010 and int(got[4]) in (5, vocab - 1)
