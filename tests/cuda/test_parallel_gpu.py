"""Tensor parallelism over two GPUs (NCCL) and a layer split over a GPU and the CPU: the same
logits (float32, within the reduction order's rounding) and greedy tokens as one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.model import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from parallel_cases import assert_logits_close, greedy_jobs, step_logits  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("variant", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_tp_two_gpus_matches_one(variant, tmp_path) -> None:
    from engine.parallel.launch import start_tensor_parallel

    build_tiny_model(variant, tmp_path)
    single = load_model(tmp_path, device="cuda", dtype="float32")
    reference_logits = [t.cpu() for t in step_logits(single)]
    reference_tokens, _ = greedy_jobs(single)
    del single
    model, run, _ = start_tensor_parallel(tmp_path, 2, device="cuda", dtype="float32")
    with run:
        assert_logits_close([t.cpu() for t in step_logits(model)], reference_logits)
        tokens, cached = greedy_jobs(model)
    assert cached > 0 and tokens == reference_tokens


def test_layer_split_gpu_and_cpu_matches_one_gpu(tmp_path) -> None:
    from engine.parallel.placement import split_layers

    build_tiny_model("LlamaForCausalLM", tmp_path)
    single = load_model(tmp_path, device="cuda", dtype="float32")
    reference_logits = [t.cpu() for t in step_logits(single)]
    reference_tokens, _ = greedy_jobs(single)
    model = load_model(tmp_path, device="cuda", dtype="float32")
    split = split_layers(model, [2, 2], [torch.device("cuda", 0), torch.device("cpu")])
    assert split.module.blocks[3].block.mixer.o_proj.weight.device.type == "cpu"
    assert_logits_close([t.cpu() for t in step_logits(split)], reference_logits)
    tokens, _ = greedy_jobs(split)
    assert tokens == reference_tokens
