"""Pipelined sampled decode on the GPU (CUDA graphs, the device sampler with pending tokens): seeded
jobs give the tokens of the unpipelined path, with penalties, mixed greedy and sampled rows, stop
tokens and jobs of different lengths; both sampling kernels."""

import functools
import sys
from pathlib import Path

import pytest

from engine.generation import generator as generator_module
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.kernels import sampling as kernel_sampling
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from generation_cases import SAMPLED_SETTINGS  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda

SETTINGS = [*SAMPLED_SETTINGS, SamplingSettings.greedy()]  # plain greedy in the same batch too


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build_tiny_model("LlamaForCausalLM", directory)
    return load_model(directory, device="cuda", dtype="float32")


def _generate(model, pipeline: bool, limits, stop=()):
    options = EngineOptions(pipelined_decode=pipeline, sampling_on_device=True)
    gen = Generator(model, cache_tokens=2048, page_size=16, options=options)
    assert gen._use_graphs
    jobs = [
        Job(list(range(3 + i, 3 + i + n)), max_new_tokens=m, sampling=s, stop_token_ids=stop)
        for i, (n, m, s) in enumerate(zip((5, 16, 29, 9, 12, 7), limits, SETTINGS))
    ]
    landed = []
    land = gen._land
    gen._land = lambda: landed.append(gen._flight.sampled) or land()
    results = [(r.token_ids, r.stop_reason) for r in gen.generate(jobs)]
    assert gen.cache.pages.available == gen.cache.num_pages and gen._flight is None
    return results, sum(landed)


@pytest.mark.parametrize("single_block", [False, True])
def test_pipelined_sampled_decode_gives_the_unpipelined_tokens(model, single_block, monkeypatch):
    if single_block:  # the one-block-per-row kernel of older GPUs, where the cluster one would run
        single = functools.partial(kernel_sampling.sample_tokens, cluster=False)
        monkeypatch.setattr(kernel_sampling, "sample_tokens", single)
    limits = (40, 13, 40, 25, 33, 40)
    piped, sampled_landings = _generate(model, True, limits)
    assert sampled_landings >= 30  # the pipeline really ran, sampled
    plain, none = _generate(model, False, limits)
    assert none == 0
    assert piped == plain
    assert [len(ids) for ids, _ in piped] == list(limits)
    # Stop tokens: end some jobs early, mid-pipeline.
    stop = (piped[0][0][6], piped[2][0][17])
    a, _ = _generate(model, True, limits, stop)
    b, _ = _generate(model, False, limits, stop)
    assert a == b and a[0][1] == "eos"


def test_sampling_inputs_uploaded_on_a_side_stream_change_no_token(model, monkeypatch):
    """The sampled steps' settings, penalty lists and uniforms go to the GPU on a side stream
    (generator._upload_aside), the compute stream waiting for it: the seeded tokens of the
    unpipelined run."""
    uploads = []
    real = generator_module._upload_aside
    monkeypatch.setattr(generator_module, "_upload_aside", lambda *a: uploads.append(1) or real(*a))
    limits = (40, 13, 40, 25, 33, 40)
    piped, _ = _generate(model, True, limits)
    assert len(uploads) >= 30
    plain, _ = _generate(model, False, limits)
    assert piped == plain
