"""The sampler as a list of processors: which of them the GPU kernel applies, where a batch is
drawn (engine.generation.device_sampling.sampling_path), and the logit bias, a processor the
kernel lacks: it runs on the host, through the same reference, with no CUDA involved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.generation import generator as generator_mod
from engine.generation.device_sampling import sampling_path
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import (
    PROCESSORS,
    Sampler,
    SamplingSettings,
    active_processors,
    pack_rows,
    sample_reference,
)
from engine.options import EngineOptions


def test_every_processor_says_whether_the_kernel_applies_it():
    assert [(p.name, p.device) for p in PROCESSORS] == [
        ("logit_bias", False),  # first: OpenAI adds it to the raw logits, before anything else
        ("repetition_penalty", True),
        ("presence_frequency_penalty", True),
        ("dry", False),
        ("constraint", False),
        ("banned_strings", False),
        ("temperature", True),
        ("top_n_sigma", False),
        ("top_k", True),
        ("typical_p", False),
        ("top_p", True),
        ("min_p", True),
        ("xtc", False),  # random (a coin per token): after every truncation
    ]


def test_plain_greedy_means_no_active_processor():
    assert not active_processors(SamplingSettings.greedy())
    assert active_processors(SamplingSettings(temperature=0.0, top_p=0.5, min_p=0.1)) == []
    assert active_processors(SamplingSettings(temperature=0.0, logit_bias={3: 1.0}))
    assert active_processors(SamplingSettings(temperature=0.0, repetition_penalty=1.1))
    names = [p.name for p in active_processors(SamplingSettings(top_k=5, logit_bias={1: 2.0}), True)]
    assert names == ["logit_bias", "constraint", "temperature", "top_k"]


def test_the_path_each_batch_takes():
    sampled = SamplingSettings(temperature=0.7, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2)
    biased = dataclasses.replace(sampled, logit_bias={5: 2.0})
    greedy = SamplingSettings.greedy()
    assert sampling_path([greedy, greedy]) == "argmax"
    assert sampling_path([greedy, sampled]) == "device"
    # As on a GPU (device sampling on): a logit bias, which the kernel lacks, sends the step to
    # the host, every row of it, greedy ones included.
    assert sampling_path([biased]) == "host"
    assert sampling_path([sampled, biased, greedy]) == "host"
    assert sampling_path([dataclasses.replace(greedy, logit_bias={5: 2.0})]) == "host"
    assert sampling_path([sampled, greedy], [False, True]) == "host"  # a constraint's mask
    assert sampling_path([greedy], [True]) == "host"
    assert sampling_path([sampled], device_sampling=False) == "host"
    assert sampling_path([greedy], device_sampling=False) == "argmax"


def test_logit_bias_is_added_to_the_raw_logits_before_everything_else():
    # Draw for draw the tokens of the same sampler given the logits with the bias added by hand:
    # the penalties (the repetition penalty divides by sign) see the biased logits.
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    bias = {3: 2.5, 40: -1.0, 120: 0.75, 1000: 5.0}  # 1000 is past the vocabulary: ignored
    s = SamplingSettings(
        temperature=0.9, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.2, seed=4, logit_bias=bias
    )
    by_hand = logits.clone()
    for token, value in bias.items():
        if token < 300:
            by_hand[token] += value
    context, generated = [3, 7, 40, 40, 120], [40, 120]
    biased, plain = Sampler(s), Sampler(dataclasses.replace(s, logit_bias={}))
    got = [biased.sample(logits, context, generated) for _ in range(100)]
    assert got == [plain.sample(by_hand, context, generated) for _ in range(100)]
    unbiased = Sampler(dataclasses.replace(s, logit_bias={}))
    assert got != [unbiased.sample(logits, context, generated) for _ in range(100)]


def test_logit_bias_moves_the_distribution_to_the_softmax_of_the_biased_logits():
    x = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    s = SamplingSettings(temperature=0.8, logit_bias={4: 3.0, 0: -2.0})
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(5))
    rows = pack_rows([s] * n, [[]] * n, [[]] * n)
    draws = sample_reference(x.expand(n, -1), rows, u, settings=[s] * n)
    expected = torch.softmax((x + torch.tensor([-2.0, 0.0, 0.0, 0.0, 3.0])) / 0.8, -1)
    assert torch.allclose(torch.bincount(draws, minlength=5).float() / n, expected, atol=0.01)
    # Without the rows' settings the reference computes what the kernel does: no bias (the
    # routing never gives the kernel a biased row).
    unbiased = sample_reference(x.expand(n, -1), rows, u)
    freq = torch.bincount(unbiased, minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(x / 0.8, -1), atol=0.01)


def test_a_bias_of_plus_100_forces_a_token_and_minus_100_bans_one():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 5
    worst, best, second = int(logits.argmin()), int(logits.argmax()), int(logits.topk(2).indices[1])
    forced = SamplingSettings(temperature=0.0, logit_bias={worst: 100.0})
    assert Sampler(forced).sample(logits, [], []) == worst
    sampler = Sampler(SamplingSettings(temperature=1.0, seed=3, logit_bias={worst: 100}))
    assert {sampler.sample(logits, [], []) for _ in range(50)} == {worst}
    banned = SamplingSettings(temperature=0.0, logit_bias={best: -100.0})
    assert Sampler(banned).sample(logits, [], []) == second
    sampler = Sampler(dataclasses.replace(banned, temperature=1.0, seed=0))
    assert best not in {sampler.sample(logits, [], []) for _ in range(200)}


def _counting(monkeypatch):
    device, host = [], []
    original, sample = generator_mod._sample_rows, Sampler.sample
    monkeypatch.setattr(generator_mod, "_sample_rows", lambda *a: device.append(1) or original(*a))
    monkeypatch.setattr(Sampler, "sample", lambda *a, **k: host.append(1) or sample(*a, **k))
    return device, host


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_generator_samples_a_biased_job_on_the_host(llama, monkeypatch, pipeline):
    # device_sampling on, as on a GPU: the step holding the biased job goes to the host whole,
    # and gives what host-only sampling gives.
    device, host = _counting(monkeypatch)

    def run(device_sampling: bool, settings):
        options = EngineOptions(sampling_on_device=device_sampling, pipelined_decode=pipeline)
        gen = Generator(llama, cache_tokens=1024, page_size=16, options=options)
        jobs = [
            Job(list(range(5 + 3 * i, 14 + 3 * i)), max_new_tokens=8, sampling=s, stop_token_ids=())
            for i, s in enumerate(settings)
        ]
        return [r.token_ids for r in gen.generate(jobs)]

    plain = SamplingSettings(temperature=0.9, top_k=50, seed=1)
    forced = SamplingSettings(temperature=0.0, logit_bias={17: 100.0})
    mixed = run(True, [plain, forced])
    assert not device and len(host) == 16
    assert mixed[1] == [17] * 8
    assert mixed == run(False, [plain, forced])
    host.clear()
    run(True, [plain])
    assert not host  # alone, the unbiased job is drawn where the logits are
