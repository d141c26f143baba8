"""GLM-4.1V and GLM-4.5V (tests/engine/tiny_glm4v.py) on a GPU: a prompt with an image decoded
greedily beside a text-only one gives the CPU's 32 tokens each (both in float32; a sequence may
part from the CPU's only where the CPU's own logits tie to 1e-5 of their scale); and GLM-4.1V's
text-only decode steps replay from CUDA graphs with the CPU's tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from parity import random_ids
from PIL import Image

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.options import EngineOptions
from engine.tokenizer import Tokenizer
from engine.vision.prompt import encode_chat_with_images, user_message

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_glm4v import GLM4V, VARIANTS, build_tiny_glm4v  # noqa: E402

pytestmark = pytest.mark.cuda

PICTURE = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 45, 3), dtype=np.uint8))
TEXT_PROMPTS = [random_ids(n, seed=n) for n in (5, 23, 12)]


def _image_jobs(model, directory: Path):
    """A prompt with PICTURE (its media encoded by ``model``'s own tower) and a text-only one."""
    messages = [user_message("What is in this picture?", 1)]
    ids, media = encode_chat_with_images(Tokenizer.from_dir(directory), model.vision, messages, [PICTURE])
    return [
        Job(ids, max_new_tokens=32, stop_token_ids=(), media=media),
        Job(TEXT_PROMPTS[1], max_new_tokens=32, stop_token_ids=()),
    ]


def _assert_same_tokens(cpu, job: Job, expected: list[int], got: list[int]) -> None:
    """Equal tokens, or a first difference at a tie of the CPU's logits (then the rest differs)."""
    if got == expected:
        return
    i = next(k for k, (a, b) in enumerate(zip(expected, got)) if a != b)
    cache = PagedKVCache.for_model(cpu.spec, 256, page_size=16)
    logits = score_tokens(cpu.module, cache, list(job.input_ids) + expected[:i], media=job.media)[-1]
    gap = (logits[expected[i]] - logits[got[i]]).abs().item()
    assert gap < 1e-5 * logits.abs().max().item(), f"diverged at token {i} with a margin of {gap}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_after_an_image_equal_the_cpus(variant, tmp_path):
    build_tiny_glm4v(variant, tmp_path)
    cpu = load_model(tmp_path, device="cpu")
    gpu = load_model(tmp_path, device="cuda", dtype="float32")
    cpu_jobs, gpu_jobs = _image_jobs(cpu, tmp_path), _image_jobs(gpu, tmp_path)
    assert cpu_jobs[0].input_ids == gpu_jobs[0].input_ids
    expected = Generator(cpu, cache_tokens=512, page_size=16).generate(cpu_jobs)
    got = Generator(gpu, cache_tokens=512, page_size=16).generate(gpu_jobs)
    assert [len(r.token_ids) for r in got] == [32, 32]
    for job, want, result in zip(cpu_jobs, expected, got):
        _assert_same_tokens(cpu, job, want.token_ids, result.token_ids)


def test_glm4v_text_decode_runs_in_cuda_graphs(tmp_path):
    build_tiny_glm4v(GLM4V, tmp_path)
    cpu = load_model(tmp_path, device="cpu")
    gpu = load_model(tmp_path, device="cuda", dtype="float32")
    assert gpu.module.static_decode

    def greedy(model, graphs: bool):
        jobs = [Job(prompt, max_new_tokens=32, stop_token_ids=()) for prompt in TEXT_PROMPTS]
        gen = Generator(model, cache_tokens=512, page_size=16, options=EngineOptions(cuda_graphs=graphs))
        return jobs, [r.token_ids for r in gen.generate(jobs)], gen

    jobs, expected, _ = greedy(cpu, graphs=False)
    _, got, gen = greedy(gpu, graphs=True)
    assert gen._graphs is not None and gen._graphs.failed is None, gen._graphs.failed
    assert gen._graphs.captured  # the decode steps really went through graphs
    for job, want, tokens in zip(jobs, expected, got):
        _assert_same_tokens(cpu, job, want, tokens)
