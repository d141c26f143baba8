"""``--experts-on cpu`` on a GPU: the routed experts in pinned host memory, run on the CPU, the
rest on the GPU; greedy tokens (and float32 logits) as the all-GPU run's, less GPU memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.modules.moe import SparseMoE

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from generation_cases import random_prompts  # noqa: E402
from parallel_cases import assert_logits_close, step_logits  # noqa: E402
from tiny_gpt_oss import build_tiny_gpt_oss  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


def _build(variant: str, directory: Path) -> None:
    if variant == "gpt-oss":
        build_tiny_gpt_oss(directory)
    else:
        build_tiny_model(variant, directory)


def _greedy_pair(model, tokens: int = 32) -> list[list[int]]:
    gen = Generator(model, cache_tokens=512, page_size=16, max_batch_size=2)
    jobs = [Job(p, tokens, stop_token_ids=[]) for p in random_prompts([29, 17], seed=5)]
    return [r.token_ids for r in gen.generate(jobs)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["Qwen3MoeForCausalLM", "gpt-oss"])
def test_experts_on_cpu_match_the_all_gpu_run(variant, dtype, tmp_path) -> None:
    _build(variant, tmp_path)
    gpu = load_model(tmp_path, device="cuda", dtype=dtype)
    reference_logits = [t.float().cpu() for t in step_logits(gpu)]
    reference_tokens = _greedy_pair(gpu)
    del gpu
    torch.cuda.empty_cache()
    hosted = load_model(tmp_path, device="cuda", dtype=dtype, experts_on="cpu")
    moes = [m for m in hosted.module.modules() if isinstance(m, SparseMoE)]
    assert moes
    for moe in moes:
        weights = list(moe.experts.parameters())
        assert all(w.device.type == "cpu" and w.is_pinned() for w in weights)
        assert moe.router.weight.device.type == "cuda"
    if dtype == "float32":
        assert_logits_close([t.float().cpu() for t in step_logits(hosted)], reference_logits)
    tokens = _greedy_pair(hosted)
    assert tokens == reference_tokens and all(len(t) == 32 for t in tokens)


def test_synthetic_exl3_experts_on_cpu_run_and_use_less_gpu_memory() -> None:
    """A small Qwen3-MoE shape at 4 bpw: its EXL3 experts dequantized once into bf16 host memory;
    the logits stay within the dequantization's rounding of the all-GPU run's."""
    from engine.loading.synthetic_store import synthetic_model

    shape = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    cuda = torch.device("cuda")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    gpu = synthetic_model(shape, 4, cuda, torch.bfloat16)
    all_gpu_bytes = torch.cuda.memory_allocated() - before
    reference = [t.float().cpu() for t in step_logits(gpu)]
    del gpu
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    hosted = synthetic_model(shape, 4, cuda, torch.bfloat16, experts_on="cpu")
    hosted_bytes = torch.cuda.memory_allocated() - before
    assert hosted_bytes < all_gpu_bytes / 2
    ours = [t.float().cpu() for t in step_logits(hosted)]
    for a, b in zip(ours, reference):
        assert (a - b).abs().max().item() <= 0.05 * max(1.0, b.abs().max().item())
    assert len(_greedy_pair(hosted)[0]) == 32
