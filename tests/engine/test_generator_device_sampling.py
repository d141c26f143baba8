"""The generator's device sampling (sampled jobs whose processors the kernel all applies, drawn
where the logits are by engine.kernels.sampling.sample_tokens): on the CPU it runs the torch
reference, so the scheduling and the random streams are checked here against host sampling;
tests/cuda/test_sampling_kernel.py checks the kernel."""

import torch

from engine.generation import generator as generator_mod
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import Sampler, SamplingSettings
from engine.options import EngineOptions

SETTINGS = [
    SamplingSettings(temperature=0.9, seed=1),
    SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, seed=2),
    SamplingSettings(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=3),
    SamplingSettings(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, seed=4),  # greedy
    SamplingSettings(temperature=1.0, top_p=0.5, frequency_penalty=0.2, seed=5),
]


def _jobs():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 30, 4, 17, 12)]
    return [
        Job(p, max_new_tokens=n, sampling=s, stop_token_ids=())
        for p, n, s in zip(prompts, (12, 7, 15, 10, 9), SETTINGS)
    ]


def _run(llama, device_sampling: bool):
    options = EngineOptions(sampling_on_device=device_sampling)
    gen = Generator(llama, cache_tokens=1024, page_size=16, max_batch_size=4, options=options)
    return [(r.token_ids, r.stop_reason) for r in gen.generate(_jobs())]


def test_device_sampling_gives_the_host_samplers_tokens(llama, monkeypatch):
    calls, host_calls = [], []
    original, host = generator_mod._sample_rows, Sampler.sample
    monkeypatch.setattr(generator_mod, "_sample_rows", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(Sampler, "sample", lambda *a, **k: host_calls.append(1) or host(*a, **k))
    on_device = _run(llama, device_sampling=True)
    assert len(calls) >= 10 and not host_calls  # every token came through _draw_rows
    calls.clear()
    on_host = _run(llama, device_sampling=False)
    assert not calls and len(host_calls) == 12 + 7 + 15 + 10 + 9
    # Same seeds, same uniforms in the same order, the same decision rules: the same tokens.
    assert on_device == on_host
    assert all(len(ids) == n for (ids, _), n in zip(on_device, (12, 7, 15, 10, 9)))


def test_host_sampling_option_turns_it_off(llama):
    host = EngineOptions.from_environment({"TRELLIS_HOST_SAMPLING": "1"})
    assert host.sampling_on_device is False
    assert Generator(llama, cache_tokens=256, page_size=16, options=host)._device_sampling is False
    # A CPU model samples on the host unless asked.
    assert Generator(llama, cache_tokens=256, page_size=16)._device_sampling is False
    forced = EngineOptions(sampling_on_device=True)
    assert Generator(llama, cache_tokens=256, page_size=16, options=forced)._device_sampling
