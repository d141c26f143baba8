"""How a model's memory divides between the GPU and system memory for each placement, and which
placement is suggested for a GPU of a given size (engine.placement_memory)."""

from __future__ import annotations

import pytest
from model_infos import GIB, model_info

from engine.placement_memory import layers_that_fit, memory_split, suggest_placement


def test_all_on_the_gpu_is_the_whole_estimate() -> None:
    info = model_info()
    split = memory_split(info, 4096)
    assert split.gpu_bytes == info.memory_needed(4096, "cuda") and split.host_bytes == 0


def test_experts_in_system_memory_move_their_bytes_and_overhead() -> None:
    info = model_info(expert_weight_bytes=16 * GIB, expert_parameter_count=8 * GIB)
    whole = memory_split(info, 4096).gpu_bytes
    split = memory_split(info, 4096, placement="experts")
    assert split.host_bytes == 16 * GIB and split.gpu_bytes == whole - int(16 * GIB * 1.1)
    # EXL3 experts are dequantized to 16 bits in system memory: 2 bytes per parameter
    exl3 = model_info(
        quantization="EXL3 4.0 bpw", expert_weight_bytes=4 * GIB, expert_parameter_count=8 * GIB
    )
    assert memory_split(exl3, 4096, placement="experts").host_bytes == 16 * GIB


def test_layers_split_by_count() -> None:
    info = model_info()
    kv = info.kv_cache_bytes(4096)
    whole = memory_split(info, 4096).gpu_bytes
    split = memory_split(info, 4096, placement="layers", gpu_layers=4)
    assert split.host_bytes == int(19 * GIB * 0.6) + int(kv * 0.6)
    assert split.gpu_bytes == whole - int((int(19 * GIB * 0.6) + int(kv * 0.6)) * 1.1)
    assert memory_split(info, 4096, placement="layers", gpu_layers=10).host_bytes == 0
    with pytest.raises(ValueError, match="placement must be one of"):
        memory_split(info, 4096, placement="disk")


def test_the_suggestion_follows_the_gpu_size() -> None:
    moe = model_info(expert_weight_bytes=16 * GIB, expert_parameter_count=8 * GIB)
    assert suggest_placement(moe, 4096, (16, 16), 40 * GIB).placement == "gpu"
    assert suggest_placement(moe, 4096, (16, 16), 0).placement == "gpu"  # GPU size unknown
    assert suggest_placement(moe, 4096, (16, 16), 8 * GIB).placement == "experts"
    tiny_gpu = suggest_placement(moe, 4096, (16, 16), 3 * GIB)
    assert tiny_gpu.placement == "layers" and tiny_gpu.gpu_layers == layers_that_fit(
        moe, 4096, (16, 16), 3 * GIB
    )
    dense = suggest_placement(model_info(), 4096, (16, 16), 12 * GIB)
    n = dense.gpu_layers
    assert dense.placement == "layers" and 0 < n < 10
    assert memory_split(model_info(), 4096, (16, 16), "layers", n).gpu_bytes <= 12 * GIB
    assert memory_split(model_info(), 4096, (16, 16), "layers", n + 1).gpu_bytes > 12 * GIB


def test_the_library_reads_the_experts_and_layers_share(tiny_model_factory) -> None:
    from engine.inspect import inspect_model

    moe = inspect_model(tiny_model_factory("Qwen3MoeForCausalLM")[0])
    assert 0 < moe.expert_weight_bytes < moe.layer_weight_bytes < moe.weight_bytes
    # 3 of its 4 layers are mixtures of 8 experts of 3 projections 64 x 32 (float32)
    assert moe.expert_parameter_count == 3 * 8 * 3 * 64 * 32
    dense = inspect_model(tiny_model_factory("LlamaForCausalLM")[0])
    assert dense.expert_weight_bytes == 0 and 0 < dense.layer_weight_bytes < dense.weight_bytes
