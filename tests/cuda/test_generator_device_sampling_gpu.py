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
    gen = Generator(
        model, cache_tokens=1024, page_size=16, cuda_graphs=graphs, device_sampling=device_sampling
    )
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
    # Host: float32 softmax; device: integer weights. They differ only when a uniform falls
    # within ~1e-7 of a boundary of the cumulative distribution (not with these seeds).
    assert on_device == on_host
