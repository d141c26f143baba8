"""Sampled jobs drawn on the GPU (ext/sampling.cu through the generator) give the tokens the host
sampler gives for the same seeds, with and without CUDA graphs."""

import sys
from pathlib import Path

import pytest

from engine.generation import generator as generator_mod
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda

SETTINGS = [
    SamplingSettings(temperature=0.9, seed=1),
    SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, seed=2),
    SamplingSettings(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=3),
    SamplingSettings(temperature=1.0, top_p=0.5, presence_penalty=0.4, frequency_penalty=0.2, seed=5),
]


def _generate(model, graphs: bool, device_sampling: bool):
    options = EngineOptions(cuda_graphs=graphs, sampling_on_device=device_sampling)
    gen = Generator(model, cache_tokens=1024, page_size=16, options=options)
    jobs = [
        Job(list(range(3 + i, 3 + i + n)), max_new_tokens=24, sampling=s, stop_token_ids=())
        for i, (n, s) in enumerate(zip((5, 16, 29, 9), SETTINGS))
    ]
    return [r.token_ids for r in gen.generate(jobs)]


@pytest.mark.parametrize("graphs", [False, True])
def test_device_sampling_equals_host_sampling(graphs, tmp_path, monkeypatch):
    build_tiny_model("LlamaForCausalLM", tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="float32")
    calls = []
    original = generator_mod._draw_rows  # every device draw, pipelined (graphs) or not
    monkeypatch.setattr(generator_mod, "_draw_rows", lambda *a: calls.append(1) or original(*a))
    on_device = _generate(model, graphs, device_sampling=True)
    assert len(calls) >= 23
    on_host = _generate(model, graphs, device_sampling=False)
    # Host and device take one definition (integer weights); only exp's rounding on the CPU vs
    # the GPU could move a boundary of the cumulative distribution (not with these seeds).
    assert on_device == on_host


def test_a_logit_bias_job_sends_its_steps_to_the_host(tmp_path, monkeypatch):
    """The kernel has no logit bias: a step with a biased job is sampled on the host, every row of
    it, and gives the host-only run's tokens; the forced token (+100) is all the job writes."""
    build_tiny_model("LlamaForCausalLM", tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="float32")
    biased = SamplingSettings(temperature=0.8, seed=9, logit_bias={17: 100.0})
    calls = []
    original = generator_mod._draw_rows
    monkeypatch.setattr(generator_mod, "_draw_rows", lambda *a: calls.append(1) or original(*a))

    def run(device_sampling: bool, settings):
        options = EngineOptions(sampling_on_device=device_sampling)
        gen = Generator(model, cache_tokens=1024, page_size=16, options=options)
        jobs = [
            Job(list(range(3 + i, 3 + i + n)), max_new_tokens=12, sampling=s, stop_token_ids=())
            for i, (n, s) in enumerate(zip((5, 16), settings))
        ]
        return [r.token_ids for r in gen.generate(jobs)]

    mixed = run(True, [SETTINGS[1], biased])
    assert not calls  # the biased job shares every step with the other: all on the host
    assert mixed == run(False, [SETTINGS[1], biased])
    assert mixed[1] == [17] * 12
    run(True, [SETTINGS[1]])
    assert calls  # alone, the other job draws on the GPU


def test_wide_decode_steps_take_the_batched_path_with_the_same_tokens(tmp_path, monkeypatch):
    """12 jobs at once: more rows than the decode graphs hold, so their steps run eagerly; on the
    GPU those go through the fixed-shape batched path and give the row-by-row path's tokens (in
    float32, as the converter's self-calibration runs it; there the two differ by float rounding
    only)."""
    build_tiny_model("LlamaForCausalLM", tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="float32")
    widths = []
    original = generator_mod.run_decode_step
    monkeypatch.setattr(
        generator_mod, "run_decode_step", lambda *a, **k: widths.append(len(a[2])) or original(*a, **k)
    )

    def run(batched):
        options = EngineOptions(batched_decode=batched)
        gen = Generator(model, cache_tokens=2048, page_size=16, max_batch_size=12, options=options)
        jobs = [Job(list(range(3 + i, 10 + 2 * i)), max_new_tokens=16, stop_token_ids=()) for i in range(12)]
        return [r.token_ids for r in gen.generate(jobs)]

    row_by_row = run(False)
    assert not widths
    assert run(None) == row_by_row  # the default on a CUDA model is the batched path
    assert max(widths) == 12
