"""The one batched reference (engine.generation.sampling.sample_reference): what the GPU sampler
computes, what the host Sampler runs on one row, and what the generator runs where
engine.kernels.sampling.sample_tokens has no kernel.
A batch decides each row as that row alone would, and the host Sampler (penalty lists from its
own context ids, its own uniforms) takes the batch's decision."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.generation.sampling import (
    Sampler,
    SamplingRows,
    SamplingSettings,
    apply_penalties,
    apply_penalties_rows,
    pack_rows,
    sample_reference,
    truncate,
)
from engine.kernels import sampling as kernel


def _reference(logits: torch.Tensor, s: SamplingSettings, context, generated, u: float) -> int:
    rows = pack_rows([s], [sorted(set(context))], [generated])
    return int(sample_reference(logits[None], rows, torch.tensor([u], dtype=torch.float32))[0])


def _host(logits: torch.Tensor, s: SamplingSettings, context, generated, u: float) -> int:
    return Sampler(dataclasses.replace(s, seed=0)).sample(logits, context, generated, u=u)


def _random_case(g: torch.Generator, vocab: int) -> tuple[torch.Tensor, SamplingSettings, list, list, float]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    s = SamplingSettings(
        temperature=pick([0.0, 0.3, 0.7, 1.0, 1.5]),
        top_k=pick([0, 0, 1, 5, 40, vocab - 1, vocab, vocab + 10]),
        top_p=pick([1.0, 1.0, 0.5, 0.9, 0.95]),
        min_p=pick([0.0, 0.0, 0.02, 0.1, 0.5]),
        repetition_penalty=pick([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=pick([0.0, 0.0, 0.5, -0.4]),
        frequency_penalty=pick([0.0, 0.0, 0.3]),
    )
    logits = torch.randn(vocab, generator=g) * pick([0.5, 2.0, 5.0])
    context = torch.randint(0, vocab, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g).tolist()
    generated = context[len(context) // 2 :]
    u = float(torch.rand(1, generator=g))
    return logits, s, context, generated, u


@pytest.mark.parametrize("vocab", [7, 1000, 5000])
def test_reference_takes_the_host_samplers_decision(vocab):
    # One definition: the host Sampler runs the reference on one row, so only its own inputs
    # (context ids kept incrementally, the uniform passed through float32) could differ.
    g = torch.Generator().manual_seed(vocab)
    cases = [_random_case(g, vocab) for _ in range(60)]
    for logits, s, context, generated, u in cases:
        assert _host(logits, s, context, generated, u) == _reference(logits, s, context, generated, u)

    # The same cases as one batch: each row's decision is its own.
    rows = pack_rows([c[1] for c in cases], [sorted(set(c[2])) for c in cases], [c[3] for c in cases])
    batch = sample_reference(torch.stack([c[0] for c in cases]), rows, torch.tensor([c[4] for c in cases]))
    assert batch.tolist() == [_reference(*c) for c in cases]


def test_many_uniforms_walk_the_kept_tokens_in_ascending_id_order():
    # Kept tokens 0..3 with probabilities 0.1, 0.4, 0.2, 0.3 (token 4 cut by top-k): u sweeps the
    # cumulative distribution in id order, on the host and in the reference alike.
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0001])
    logits = probs.log()
    s = SamplingSettings(temperature=1.0, top_k=4)
    for u, token in [(0.05, 0), (0.11, 1), (0.49, 1), (0.51, 2), (0.69, 2), (0.71, 3), (0.999, 3)]:
        assert _reference(logits, s, [], [], u) == token
        assert _host(logits, s, [], [], u) == token


def test_top_k_above_the_vocabulary_and_top_p_one_change_nothing():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, generator=g) * 2
    plain = SamplingSettings(temperature=0.9)
    for u in torch.rand(50, generator=g).tolist():
        expected = _reference(logits, plain, [], [], u)
        assert _reference(logits, dataclasses.replace(plain, top_k=301), [], [], u) == expected
        assert _reference(logits, dataclasses.replace(plain, top_k=300), [], [], u) == expected
        assert _reference(logits, dataclasses.replace(plain, top_p=1.0), [], [], u) == expected


def test_min_p_cutting_all_but_one_is_the_argmax():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, -2.0])  # p(3) / p(1) = e^-1 ~ 0.37
    s = SamplingSettings(temperature=1.0, min_p=0.5)
    for u in [0.0, 0.3, 0.9999]:
        assert _reference(logits, s, [], [], u) == 1
        assert _host(logits, s, [], [], u) == 1


def test_greedy_is_the_first_argmax_after_penalties():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.9])
    for s in [SamplingSettings.greedy(), SamplingSettings(temperature=0.8, top_k=1)]:
        assert _reference(logits, s, [], [], 0.5) == 1  # the first of the tied maxima
    # Penalties first: tokens 1 and 2 repeated, 3 wins.
    s = SamplingSettings(temperature=0.0, repetition_penalty=1.2)
    assert _reference(logits, s, [1, 2], [], 0.5) == 3 == _host(logits, s, [1, 2], [], 0.5)


def test_batched_penalties_are_each_rows_own():
    s = [
        SamplingSettings(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingSettings(),
        SamplingSettings(repetition_penalty=0.5),
        SamplingSettings(frequency_penalty=-1.0),
    ]
    contexts, generated = [[0, 1, 2], [1, 3], [3, 2, 3], []], [[2, 2], [3], [3, 3], [0, 0, 1]]
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]] * 4)
    got = apply_penalties_rows(logits, pack_rows(s, [sorted(set(c)) for c in contexts], generated))
    assert got[0].tolist() == [1.0, -4.0, 0.5 - 0.5 - 0.5, 1.0]
    assert torch.equal(got[1], logits[1]) and got[2].tolist() == [2.0, -2.0, 2.0, 2.0]
    for r in range(4):
        assert torch.equal(got[r], apply_penalties(logits[r], s[r], contexts[r], generated[r]))


def test_top_k_ties_at_the_boundary_are_kept_together():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    s = SamplingSettings(temperature=1.0, top_k=2)
    assert torch.isfinite(truncate(logits, s)).tolist() == [True, True, True, True, False]
    drawn = {_reference(logits, s, [], [], u) for u in torch.linspace(0, 0.999, 200).tolist()}
    assert drawn == {0, 1, 2, 3}
    assert drawn == {_host(logits, s, [], [], u) for u in torch.linspace(0, 0.999, 200).tolist()}


def test_top_p_ties_stay_or_go_together():
    # p = 0.5, 0.2, 0.2, 0.1: with top_p 0.6 the mass before token 1 (0.5) is below it, so token 1
    # stays, and token 2 has the same logit: it stays too (ranked after token 1 it would see 0.7).
    logits = torch.tensor([0.5, 0.2, 0.2, 0.1]).log()
    s = SamplingSettings(temperature=1.0, top_p=0.6)
    assert torch.isfinite(truncate(logits, s)).tolist() == [True, True, True, False]
    drawn = {_reference(logits, s, [], [], u) for u in torch.linspace(0, 0.999, 200).tolist()}
    assert drawn == {0, 1, 2}
    assert drawn == {_host(logits, s, [], [], u) for u in torch.linspace(0, 0.999, 200).tolist()}


def test_reference_draw_frequencies_follow_the_truncated_softmax():
    x = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -3.0, -9.0])
    s = SamplingSettings(temperature=0.7, top_p=0.95, min_p=0.02)
    expected = torch.softmax(truncate(x / 0.7, s), -1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(5))
    rows = pack_rows([s] * 20000, [[]] * 20000, [[]] * 20000)
    draws = sample_reference(x.expand(20000, -1), rows, u)
    freq = torch.bincount(draws, minlength=7).float() / 20000
    assert (freq[expected == 0] == 0).all()
    assert torch.allclose(freq, expected, atol=0.015)


def test_masked_tokens_are_never_drawn():
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(4))
    logits[:, ::2] = float("-inf")
    s = [SamplingSettings(temperature=1.0), SamplingSettings(temperature=1.3, top_p=0.9, top_k=300)]
    rows = pack_rows(s, [[], []], [[], []])
    for u in torch.rand(100, generator=torch.Generator().manual_seed(0)).tolist():
        ids = sample_reference(logits, rows, torch.tensor([u, u]))
        assert all(i % 2 == 1 for i in ids.tolist())


def test_the_kernel_leaves_cpu_rows_to_the_reference():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 400, generator=g).to(torch.bfloat16)
    s = [
        SamplingSettings(top_k=20),
        SamplingSettings(top_p=0.8, repetition_penalty=1.2),
        SamplingSettings.greedy(),
    ]
    rows = pack_rows(s, [[1, 2, 3]] * 3, [[3, 3, 9]] * 3)
    u = torch.rand(3, generator=g)
    assert kernel.sample_tokens(logits, rows, u) is None  # the caller runs sample_reference
    ids = sample_reference(logits, rows, u)  # bf16 logits are taken as they are (widened)
    assert torch.equal(ids, sample_reference(logits.float(), rows, u)) and ids.dtype == torch.int64


def test_the_kernel_names_bad_arguments():
    rows = pack_rows([SamplingSettings()], [[]], [[]])
    logits, u = torch.randn(1, 10), torch.rand(1)
    with pytest.raises(ValueError, match="logits"):
        kernel.sample_tokens(logits[0], rows, u)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        kernel.sample_tokens(logits.double(), rows, u)
    with pytest.raises(ValueError, match="u must be"):
        kernel.sample_tokens(logits, rows, u.double())
    with pytest.raises(ValueError, match="settings"):
        kernel.sample_tokens(torch.randn(2, 10), rows, torch.rand(2))
    bad = SamplingRows(
        rows.settings, rows.rep_ids.long(), rows.rep_len, rows.gen_ids, rows.gen_counts, rows.gen_len
    )
    with pytest.raises(ValueError, match="rep_ids"):
        kernel.sample_tokens(logits, bad, u)
    with pytest.raises(ValueError, match="out"):
        kernel.sample_tokens(logits, rows, u, torch.zeros(1, dtype=torch.float32))


def test_pack_rows_lists_only_what_the_settings_use():
    s = [
        SamplingSettings(repetition_penalty=1.5),
        SamplingSettings(frequency_penalty=0.2),
        SamplingSettings(),
    ]
    rows = pack_rows(s, [[4, 7], [4, 7], [4, 7]], [[7, 7, 2], [7, 7, 2], [7, 7, 2]])
    assert rows.rep_len.tolist() == [2, 0, 0] and rows.rep_ids[0].tolist() == [4, 7]
    assert rows.gen_len.tolist() == [0, 2, 0]
    assert rows.gen_ids[1].tolist() == [2, 7] and rows.gen_counts[1].tolist() == [1, 2]
    assert rows.settings.dtype == torch.float32 and rows.settings.shape == (3, 7)


def test_pack_rows_fields_are_views_of_one_buffer_that_moves_in_one_copy():
    s = [SamplingSettings(repetition_penalty=1.2, presence_penalty=0.5), SamplingSettings(top_k=5)]
    rows = pack_rows(s, [torch.tensor([9, 3, 5]), [1]], [[3, 3], [8]])
    start = rows.buffer.data_ptr()
    end = start + rows.buffer.numel() * 4
    for t in rows._tensors():
        assert t.numel() == 0 or start <= t.data_ptr() < end
    assert rows.settings[1, 1].item() == 5.0 and rows.settings[0, 4].item() == pytest.approx(1.2)
    moved = rows.to("cpu")
    assert moved.buffer is not None
    for a, b in zip(rows._tensors(), moved._tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert moved.rep_ids.tolist() == [[9, 3, 5], [0, 0, 0]] and moved.rep_len.tolist() == [3, 0]
    assert moved.gen_ids.tolist() == [[3]] * 1 + [[0]] and moved.gen_counts[0].tolist() == [2]
