"""MiMo, IQuest-Coder, HyperCLOVA X, nanochat, Solar Open and DeciLM on a CUDA GPU: 32 greedy
tokens for each of three prompts, decoded in CUDA graphs (Solar Open's experts are chosen per
token, so it decodes eagerly), equal to the CPU reference path's. Where TF32 rounding moves a
token, the two paths may part only at a near tie of the CPU's logits."""

import sys
from pathlib import Path

import pytest

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_more_families import BUILDERS, build_deci  # noqa: E402

pytestmark = pytest.mark.cuda

FAMILIES = [*BUILDERS, "DeciLMForCausalLM"]
PROMPTS = (5, 16, 29)  # the first one crosses a 16-token page boundary within 32 new tokens


def _jobs() -> list[Job]:
    return [
        Job(list(range(3 + i, 3 + i + n)), max_new_tokens=32, stop_token_ids=())
        for i, n in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_on_gpu_equal_the_cpu_path(family, tmp_path):
    if family == "DeciLMForCausalLM":
        build_deci(tmp_path)
    else:
        BUILDERS[family](tmp_path)
    cpu = load_model(tmp_path, device="cpu", dtype="float32")
    expected = [r.token_ids for r in Generator(cpu, cache_tokens=1024, page_size=16).generate(_jobs())]

    model = load_model(tmp_path, device="cuda", dtype="float32")
    gen = Generator(model, cache_tokens=1024, page_size=16)
    got = [r.token_ids for r in gen.generate(_jobs())]
    if family == "SolarOpenForCausalLM":
        assert not gen._use_graphs  # data-dependent expert choice: decoded eagerly
    else:
        assert gen._graphs is not None and gen._graphs.failed is None, gen._graphs.failed
        assert gen._graphs.captured  # the decode steps really went through graphs
    assert [len(t) for t in got] == [32] * len(PROMPTS)
    for job, a, b in zip(_jobs(), expected, got):
        if a == b:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        cache = PagedKVCache.for_model(cpu.spec, 1024, page_size=16)
        logits = score_tokens(cpu.module, cache, list(job.input_ids) + a[:i])[-1]
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap < 1e-3 * logits.abs().max().item(), f"diverged at token {i} with a margin of {gap}"
