"""The engine's torch path on a CUDA GPU: the same model code as on the CPU, checked against
transformers on the same GPU, and EXL3 models through the CUDA kernels against the CPU path."""

import sys
from pathlib import Path

import pytest
import torch

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    "variant", ["LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
)
def test_tiny_models_on_gpu_match_transformers(variant, tmp_path):
    reference = build_tiny_model(variant, tmp_path).cuda()
    ids = torch.randint(3, 320, (64,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None].cuda()).logits[0].float()
    model = load_model(tmp_path, device="cuda", dtype="float32")
    got = score_tokens(
        model.module, PagedKVCache.for_model(model.spec, 128, page_size=16, device="cuda"), ids.tolist()
    )
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def test_batched_generation_on_gpu_bf16(tmp_path):
    build_tiny_model("LlamaForCausalLM", tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="bfloat16")
    gen = Generator(model, cache_tokens=1024, page_size=16, cache_bits=(4, 4))
    jobs = [Job(list(range(3, 3 + n)), max_new_tokens=12, stop_token_ids=()) for n in (5, 40, 17)]
    results = gen.generate(jobs)
    assert [r.new_tokens for r in results] == [12, 12, 12]
    assert gen.cache.pages.available == gen.cache.num_pages


def test_exl3_model_on_gpu_matches_cpu(exl3_dir):
    directory = exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1"
    ids = list(range(5, 69))
    cpu = load_model(directory, device="cpu")
    expected = score_tokens(cpu.module, PagedKVCache.for_model(cpu.spec, 128), ids)
    gpu = load_model(directory, device="cuda", dtype="float16")
    got = score_tokens(
        gpu.module, PagedKVCache.for_model(gpu.spec, 128, dtype=torch.float16, device="cuda"), ids
    )
    assert (got.cpu() - expected).abs().max().item() < 0.1
    assert (got.cpu().argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.95
