"""How a model's memory divides between the GPU and system memory for each placement, and which
placement is suggested for a GPU of a given size (engine.placement_memory)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from model_infos import GIB, model_info
from sparse_models import MIB, uneven_moe

from engine.inspect import inspect_model
from engine.layer_weights import LayerWeights
from engine.placement_memory import layer_bytes, layers_that_fit, memory_split, suggest_placement


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
    moe = inspect_model(tiny_model_factory("Qwen3MoeForCausalLM")[0])
    assert 0 < moe.expert_weight_bytes < moe.layer_weight_bytes < moe.weight_bytes
    # 3 of its 4 layers are mixtures of 8 experts of 3 projections 64 x 32 (float32)
    assert moe.expert_parameter_count == 3 * 8 * 3 * 64 * 32
    dense = inspect_model(tiny_model_factory("LlamaForCausalLM")[0])
    assert dense.expert_weight_bytes == 0 and 0 < dense.layer_weight_bytes < dense.weight_bytes


def test_the_library_reads_each_layers_weights(tmp_path, tiny_model_factory) -> None:
    info = inspect_model(uneven_moe(tmp_path))
    first = LayerWeights(400 * MIB, 0, 200 * MIB)  # BF16: half as many parameters as bytes
    moe = LayerWeights(100 * MIB + 3 * GIB, 3 * GIB, (100 * MIB + 3 * GIB) // 2)
    assert info.layer_weights == (first, moe, moe, moe)
    # the vision tower's layer and the MTP layer are no decoder layer's
    assert info.layer_weight_bytes == 400 * MIB + 3 * (100 * MIB + 3 * GIB)

    # a model written by transformers: each layer's bytes are those of its tensors in the file
    directory = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    info = inspect_model(directory)
    written, experts = _bytes_per_layer(directory, 4)
    assert [layer.stored_bytes for layer in info.layer_weights] == written
    assert [layer.expert_bytes for layer in info.layer_weights] == experts
    assert experts[2] == 0 < experts[0]  # its layer 2 is a dense MLP (mlp_only_layers)


def test_a_layer_split_moves_the_layers_it_cuts_off(tmp_path) -> None:
    info = inspect_model(uneven_moe(tmp_path))
    stored = [layer.stored_bytes for layer in info.layer_weights]
    cache = info.layer_cache_bytes(4096)
    assert len(set(cache)) == 1 and sum(cache) == info.kv_cache_bytes(4096)
    whole = memory_split(info, 4096).gpu_bytes
    pieces = layer_bytes(info, 4096)
    for n in range(5):
        split = memory_split(info, 4096, placement="layers", gpu_layers=n)
        moved = sum(stored[n:]) + sum(cache[n:])
        assert split.host_bytes == moved and split.gpu_bytes == whole - int(moved * 1.1)
        assert abs(pieces.front + sum(pieces.layers[:n]) - split.gpu_bytes) <= 4
        assert sum(pieces.host_layers[n:]) == split.host_bytes

    # equal shares, as estimated where the layers are unknown: the small dense layer goes to the
    # GPU first, so the layers left in system memory are the big ones, more than equal shares say
    equal = replace(info, layer_weights=())
    for n in (1, 2, 3):
        real = memory_split(info, 4096, placement="layers", gpu_layers=n)
        shares = memory_split(equal, 4096, placement="layers", gpu_layers=n)
        assert real.host_bytes > shares.host_bytes and real.gpu_bytes < shares.gpu_bytes
    for n in (0, 4):
        assert memory_split(info, 4096, placement="layers", gpu_layers=n) == memory_split(
            equal, 4096, placement="layers", gpu_layers=n
        )
    # a GPU with room for the dense layer and one mixture of experts takes both, not one
    room = memory_split(info, 4096, placement="layers", gpu_layers=2).gpu_bytes
    assert layers_that_fit(info, 4096, (16, 16), room) == 2
    assert layers_that_fit(equal, 4096, (16, 16), room) == 1


def test_a_hybrids_layer_split_counts_each_layers_own_cache(tiny_model_factory) -> None:
    """Qwen3.5: gated delta nets keep a fixed state, the attention layer's keys and values grow
    with the context; the layers cut off take their own part of the cache."""
    info = inspect_model(tiny_model_factory("Qwen3_5ForCausalLM")[0])
    kinds = info.footprint.layout
    assert kinds == ("state", "kv", "state", "state")
    # from 8192 tokens on the snapshot pool is full (two per sequence): the states stay put
    short, long = info.layer_cache_bytes(8192), info.layer_cache_bytes(65536)
    assert sum(short) == info.kv_cache_bytes(8192) and sum(long) == info.kv_cache_bytes(65536)
    for kind, a, b in zip(kinds, short, long):
        assert (b == 8 * a) if kind == "kv" else (a == b > 0)
    stored = [layer.stored_bytes for layer in info.layer_weights]
    for n in range(5):
        split = memory_split(info, 65536, placement="layers", gpu_layers=n)
        assert split.host_bytes == sum(stored[n:]) + sum(long[n:])
    # cutting after the attention layer leaves only fixed states: less than equal shares of a
    # cache the attention layer mostly holds
    assert long[1] > sum(long) / 2
    assert sum(long[2:]) < sum(long) / 2


def test_an_exl3_layer_split_counts_each_layers_bits(exl3_dir) -> None:
    """A converted model whose layers got different bit rates: each layer as stored on the GPU,
    dequantized to 16 bits (2 bytes a parameter) in system memory."""
    info = inspect_model(exl3_dir / "tiny-llama-exl3-2.5bpw-h4-mcg")
    first, second = info.layer_weights
    assert first.stored_bytes > second.stored_bytes and first.parameters == second.parameters
    pieces, cache = layer_bytes(info, 256), info.layer_cache_bytes(256)
    assert pieces.layers == tuple(int((w.stored_bytes + c) * 1.1) for w, c in zip((first, second), cache))
    assert pieces.host_layers == (2 * first.parameters + cache[0], 2 * second.parameters + cache[1])
    assert memory_split(info, 256, placement="layers", gpu_layers=1).host_bytes == pieces.host_layers[1]


def test_nemotron_h_layers_by_their_backbone_names_and_block_types(tiny_model_factory) -> None:
    """Nemotron-H keeps its layers under ``backbone.``, and its config.json (transformers 5) lists
    the block types without a layer count; a feed-forward-only layer keeps no cache."""
    directory = tiny_model_factory("NemotronHForCausalLM")[0]
    info = inspect_model(directory)
    assert info.num_layers == 6
    assert [layer.stored_bytes for layer in info.layer_weights] == _bytes_per_layer(directory, 6)[0]
    kinds, cache = info.footprint.layout, info.layer_cache_bytes(1024)
    assert kinds == ("state", "kv", "nothing", "state", "nothing", "kv")
    assert [part == 0 for part in cache] == [kind == "nothing" for kind in kinds]
    assert sum(cache) == info.kv_cache_bytes(1024)


def _bytes_per_layer(directory, layers: int) -> tuple[list[int], list[int]]:
    """Each decoder layer's bytes in ``directory``'s safetensors file, and its routed experts',
    summed over the tensors themselves (``model.layers.{i}.``, ``backbone.layers.{i}.``)."""
    from safetensors import safe_open

    written, experts = [0] * layers, [0] * layers
    with safe_open(directory / "model.safetensors", "pt") as fh:
        for name in fh.keys():
            parts = name.split(".")
            if parts[0] in ("model", "backbone") and parts[1] == "layers":
                i, tensor = int(parts[2]), fh.get_tensor(name)
                written[i] += tensor.nbytes
                experts[i] += tensor.nbytes if ".experts." in name else 0
    return written, experts
