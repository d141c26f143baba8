"""The dense families of tests/engine/tiny_dense_families.py (GLM-4, Ernie 4.5, EXAONE 4, OLMo 3,
Command R and R7B, Arcee, Apertus, Seed-OSS) on a GPU: three sequences decoded greedily together,
every decode step replayed from a CUDA graph, give the CPU's 32 tokens each (both in float32; a
sequence may part from the CPU's only where the CPU's own logits tie to 1e-5 of their scale)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from parity import random_ids

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_dense_families import DENSE_FAMILIES, build_tiny_dense_model  # noqa: E402

pytestmark = pytest.mark.cuda


PROMPTS = [random_ids(n, seed=n) for n in (5, 23, 12)]


def _greedy_tokens(model, graphs: bool) -> tuple[list[list[int]], Generator]:
    """32 greedy tokens after each of three prompts (the longest leaves the sliding windows of 16
    behind), decoded in one batch."""
    jobs = [Job(prompt, max_new_tokens=32, stop_token_ids=()) for prompt in PROMPTS]
    gen = Generator(model, cache_tokens=512, page_size=16, options=EngineOptions(cuda_graphs=graphs))
    return [r.token_ids for r in gen.generate(jobs)], gen


def _assert_same_tokens(cpu, prompt: list[int], expected: list[int], got: list[int]) -> None:
    """Equal tokens, or a first difference at a tie of the CPU's logits (then the rest differs)."""
    if got == expected:
        return
    i = next(k for k, (a, b) in enumerate(zip(expected, got)) if a != b)
    cache = PagedKVCache.for_model(cpu.spec, 128, page_size=16)
    logits = score_tokens(cpu.module, cache, prompt + expected[:i])[-1]
    gap = (logits[expected[i]] - logits[got[i]]).abs().item()
    assert gap < 1e-5 * logits.abs().max().item(), f"diverged at token {i} with a margin of {gap}"


@pytest.mark.parametrize("variant", DENSE_FAMILIES)
def test_greedy_tokens_decoded_in_cuda_graphs_equal_the_cpus(variant, tmp_path):
    build_tiny_dense_model(variant, tmp_path)
    cpu = load_model(tmp_path, device="cpu")
    expected, _ = _greedy_tokens(cpu, graphs=False)
    model = load_model(tmp_path, device="cuda", dtype="float32")
    assert model.module.static_decode  # nothing in these layers depends on the tokens
    got, gen = _greedy_tokens(model, graphs=True)
    assert gen._graphs is not None and gen._graphs.failed is None, gen._graphs.failed
    assert gen._graphs.captured  # the decode steps really went through graphs
    assert [len(tokens) for tokens in got] == [32] * 3
    for prompt, want, tokens in zip(PROMPTS, expected, got):
        _assert_same_tokens(cpu, prompt, want, tokens)
