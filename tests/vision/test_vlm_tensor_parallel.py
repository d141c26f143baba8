"""A vision-language model under tensor parallelism (gloo, 2 processes): rank 0's vision tower
encodes the images and each step carries their embeddings to the other rank; greedy tokens of
three continuously batched image prompts (one reusing another's cached pages) are the
single-process ones."""

import numpy as np
import pytest
from PIL import Image

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.parallel.launch import start_tensor_parallel
from engine.tokenizer import Tokenizer
from engine.vision.prompt import encode_chat_with_images, user_message


def _picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (30, 45, 3), dtype=np.uint8))


def _greedy(model, tokenizer) -> tuple[list[list[int]], int]:
    messages = [user_message("What is in this picture?", 1)]
    prompts = [encode_chat_with_images(tokenizer, model.vision, messages, [_picture(s)]) for s in (1, 2, 1)]
    jobs = [Job(ids, max_new_tokens=64, stop_token_ids=[], media=media) for ids, media in prompts]
    generator = Generator(model, tokenizer, cache_tokens=1024, page_size=16, max_batch_size=3)
    generator.enqueue(jobs[0])
    generator.enqueue(jobs[1])
    out = {job: [] for job in jobs}
    cached, steps = 0, 0
    while generator.num_remaining_jobs:
        for r in generator.iterate():
            out[r.job] += r.token_ids
            if r.job is jobs[2]:
                cached = r.cached_tokens
        steps += 1
        if steps == 4:
            generator.enqueue(jobs[2])  # the first job's picture again: its pages are reused
    return [out[job] for job in jobs], cached


@pytest.mark.parametrize(
    "arch",
    [
        "Qwen2_5_VLForConditionalGeneration",
        pytest.param("Gemma3ForConditionalGeneration", marks=pytest.mark.slow),
    ],
)
def test_vlm_tp_tokens_match_single_process(arch, tiny_vlm_factory) -> None:
    directory, _, _ = tiny_vlm_factory(arch)
    tokenizer = Tokenizer.from_dir(directory)
    expected, expected_cached = _greedy(load_model(directory, device="cpu"), tokenizer)
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        tokens, cached = _greedy(model, tokenizer)
    assert [len(t) for t in tokens] == [64, 64, 64]
    assert expected_cached > 0 and cached == expected_cached
    assert tokens == expected
