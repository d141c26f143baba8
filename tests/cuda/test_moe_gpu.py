"""Mixture-of-experts models on a CUDA GPU: eager decode steps (no CUDA graphs), the same greedy
tokens as the CPU reference path. (Their logits against transformers on the GPU:
test_engine_cuda.py.)"""

import sys
from pathlib import Path

import pytest

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("variant", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_moe_greedy_tokens_on_gpu_match_cpu(variant, tmp_path):
    build_tiny_model(variant, tmp_path)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]

    def greedy(device: str) -> list[list[int]]:
        model = load_model(tmp_path, device=device, dtype="float32")
        gen = Generator(model, cache_tokens=512, page_size=16)
        if device == "cuda":
            assert not gen._use_graphs  # data-dependent expert choice: decoded eagerly
        jobs = [Job(p, max_new_tokens=12, stop_token_ids=()) for p in prompts]
        return [r.token_ids for r in gen.generate(jobs)]

    assert greedy("cuda") == greedy("cpu")
