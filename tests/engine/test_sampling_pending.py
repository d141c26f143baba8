"""The pending token of the device sampler (a pipelined step's last token, still on the device,
not yet in the packed penalty lists): the torch reference with ``pending`` must give exactly what
packing the lists with that token appended gives - the same penalised logits bit for bit, the same
draws. tests/cuda/test_sampling_pending_gpu.py holds both kernels to this reference."""

from __future__ import annotations

import pytest
import torch

from engine.generation.sampling import (
    Sampler,
    SamplingSettings,
    apply_penalties,
    apply_penalties_rows,
    pack_rows,
    sample_reference,
)
from engine.kernels import sampling as kernel


def _pick(g: torch.Generator, options: list):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def random_batch(g: torch.Generator, rows: int, vocab: int):
    """``(settings, prompts, generated, pending)``: random settings with penalties often on, and
    a pending token per row that is already in the context, already generated (so also in the
    context), new, absent (-1) or out of range."""
    settings, prompts, generated, pending = [], [], [], []
    for _ in range(rows):
        settings.append(
            SamplingSettings(
                temperature=_pick(g, [0.0, 0.6, 1.0, 1.4]),
                top_k=_pick(g, [0, 0, 1, 10, 200]),
                top_p=_pick(g, [1.0, 0.5, 0.9]),
                min_p=_pick(g, [0.0, 0.05]),
                repetition_penalty=_pick(g, [1.0, 1.3, 0.8, 2.0]),
                presence_penalty=_pick(g, [0.0, 0.5, -0.3]),
                frequency_penalty=_pick(g, [0.0, 0.25, 0.7]),
            )
        )
        span = _pick(g, [vocab, min(vocab, 12)])  # a narrow id range: many repeats
        prompt = torch.randint(0, span, (int(torch.randint(1, 80, (1,), generator=g)),), generator=g)
        gen = torch.randint(0, span, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)
        prompts.append(prompt.tolist())
        generated.append(gen.tolist())
        kind = _pick(g, ["prompt", "generated", "new", "none", "out"])
        if kind == "prompt":
            p = _pick(g, prompts[-1])
        elif kind == "generated" and generated[-1]:
            p = _pick(g, generated[-1])
        elif kind == "none":
            p = _pick(g, [-1, -7])
        elif kind == "out":
            p = vocab + int(torch.randint(0, 5, (1,), generator=g))
        else:
            p = int(torch.randint(0, vocab, (1,), generator=g))
        pending.append(p)
    return settings, prompts, generated, pending


def _pack(settings, prompts, generated, appended=None):
    """The rows as the generator packs them (context ids through a Sampler), with each row's
    ``appended`` token (if >= 0) added to its tokens first."""
    contexts, gens = [], []
    for i, (s, prompt, gen) in enumerate(zip(settings, prompts, generated)):
        extra = [appended[i]] if appended is not None and appended[i] >= 0 else []
        tokens = prompt + gen + extra
        contexts.append(Sampler(s).context_ids(tokens) if s.repetition_penalty != 1.0 else ())
        gens.append(gen + extra)
    return pack_rows(settings, contexts, gens)


@pytest.mark.parametrize("vocab", [3, 50, 1000])
def test_pending_is_the_token_appended_bit_for_bit(vocab):
    g = torch.Generator().manual_seed(vocab)
    for _ in range(12):
        n = int(torch.randint(1, 9, (1,), generator=g))
        settings, prompts, generated, pending = random_batch(g, n, vocab)
        logits = torch.randn(n, vocab, generator=g) * 3
        in_range = [p if 0 <= p < vocab else -1 for p in pending]
        appended = _pack(settings, prompts, generated, in_range)
        without = _pack(settings, prompts, generated)
        p = torch.tensor(pending, dtype=torch.int64)
        got = apply_penalties_rows(logits, without, p)
        assert torch.equal(got, apply_penalties_rows(logits, appended))
        for r in range(n):  # and the host sampler's penalties, row by row
            tokens = prompts[r] + generated[r] + ([in_range[r]] if in_range[r] >= 0 else [])
            gen = generated[r] + ([in_range[r]] if in_range[r] >= 0 else [])
            assert torch.equal(got[r], apply_penalties(logits[r].clone(), settings[r], tokens, gen))
        u = torch.rand(n, generator=g)
        expected = sample_reference(logits, appended, u)
        assert torch.equal(sample_reference(logits, without, u, p), expected)


def test_pending_already_listed_is_not_penalised_twice():
    s = SamplingSettings(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    logits = torch.tensor([[4.0, -4.0, 2.0, 1.0, 8.0]])
    rows = pack_rows([s], [[0, 1, 2]], [[2, 2]])
    got = apply_penalties_rows(logits, rows, torch.tensor([2]))[0]
    # Token 2: divided once by 2.0, then presence + 3 * frequency.
    assert got.tolist() == [2.0, -8.0, 1.0 - (0.5 + 0.75), 1.0, 8.0]
    got = apply_penalties_rows(logits, rows, torch.tensor([4]))[0]
    # Token 4: new in the context (divided) and generated once.
    assert got.tolist() == [2.0, -8.0, 1.0 - (0.5 + 0.5), 1.0, 4.0 - (0.5 + 0.25)]
    none = apply_penalties_rows(logits, rows, torch.tensor([-1]))
    assert torch.equal(none, apply_penalties_rows(logits, rows))


def test_pending_alone_brings_the_penalty():
    # Empty lists: only the pending token is penalised (the kernel's gate must open for it).
    s = SamplingSettings(temperature=0.0, repetition_penalty=10.0, frequency_penalty=1.0)
    logits = torch.tensor([[5.0, 4.9, 1.0]])
    rows = pack_rows([s], [[]], [[]])
    assert int(sample_reference(logits, rows, torch.zeros(1))[0]) == 0
    assert int(sample_reference(logits, rows, torch.zeros(1), torch.tensor([0]))[0]) == 1


def test_pending_must_be_int64_rows():
    rows = pack_rows([SamplingSettings()], [[]], [[]])
    logits, u = torch.randn(1, 10), torch.rand(1)
    with pytest.raises(ValueError, match="pending"):
        kernel.sample_tokens(logits, rows, u, pending=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="pending"):
        kernel.sample_tokens(logits, rows, u, pending=torch.zeros(2, dtype=torch.int64))
