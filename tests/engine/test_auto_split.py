"""``--split-layers auto``: the counts chosen from each GPU's free memory (mismatched cards, a
model that fits one card, one that needs the CPU, one that fits nowhere), the line that says
them, the command line's ``auto``, and a split on the CPU from fake free-memory figures that
gives the single-device logits."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch
from model_infos import model_info
from parallel_cases import assert_logits_close, step_logits
from sparse_models import uneven_moe

from engine.errors import UsageError
from engine.inspect import ModelInfo, inspect_model
from engine.model import load_model
from engine.parallel import auto_loading, command_line
from engine.parallel.auto_split import (
    DEFAULT_CACHE_TOKENS,
    GPU_MARGIN_BYTES,
    HOST_MARGIN_BYTES,
    SplitPlan,
    auto_layer_counts,
    is_auto,
    plan_split,
    usable_bytes,
)
from engine.parallel.placement import PlacedBlock, parse_split
from engine.placement_memory import layer_bytes, memory_split

GIB = 1 << 30
CPU = torch.device("cpu")


def test_mismatched_cards_fill_in_order_with_consecutive_layers() -> None:
    # 48 layers of 0.75 GiB, 2 GiB of embedding and head: 24 GiB takes 29 layers, 12 GiB 16.
    layers = [3 * GIB // 4] * 48
    assert auto_layer_counts([24 * GIB, 12 * GIB], layers, 2 * GIB, host_bytes=64 * GIB) == [29, 16, 3]
    # the smaller card first: it takes fewer, the larger one the rest, nothing for the CPU
    assert auto_layer_counts([12 * GIB, 24 * GIB], layers[:40], 2 * GIB) == [13, 27, 0]


def test_a_model_that_fits_one_card_is_not_split() -> None:
    assert auto_layer_counts([24 * GIB, 12 * GIB], [GIB] * 16, 2 * GIB) == [16, 0, 0]
    gpus = [("cuda:0", 24 * GIB), ("cuda:1", 12 * GIB)]
    plan = plan_split(_info(num_layers=16, layer_weight_bytes=16 * GIB), 4096, (16, 16), gpus)
    assert not plan.is_split and plan.devices == ("cuda:0",) and plan.counts == (16,)


def test_what_the_gpus_cannot_hold_goes_to_the_cpu_or_is_refused() -> None:
    layers, host = [GIB] * 40, [2 * GIB] * 40  # an EXL3 layer takes twice its size dequantized
    assert auto_layer_counts([10 * GIB, 6 * GIB], layers, GIB, 100 * GIB, host) == [9, 6, 25]
    with pytest.raises(UsageError, match="the GPUs hold 15 of 40 layers, and the rest needs ≈ 50.0 GiB"):
        auto_layer_counts([10 * GIB, 6 * GIB], layers, GIB, 49 * GIB, host)
    with pytest.raises(UsageError, match="there is no GPU"):
        auto_layer_counts([], layers, GIB, 8 * GIB)
    assert auto_layer_counts([], layers, GIB, None) == [40]  # system memory unknown: not checked
    with pytest.raises(UsageError, match="less than the embedding and head need"):
        auto_layer_counts([GIB // 2, 24 * GIB], layers, GIB)


def test_the_margin_keeps_a_gibibyte_or_five_percent() -> None:
    assert usable_bytes(10 * GIB) == 9 * GIB
    assert usable_bytes(80 * GIB) == 76 * GIB
    assert usable_bytes(GIB // 2) == 0


def test_the_plan_says_where_each_layer_runs() -> None:
    plan = SplitPlan(("cuda:0", "cuda:1", "cpu"), (28, 12, 8), (int(21.3 * GIB), 11 * GIB, 0))
    assert plan.describe() == (
        "layers 0-27 on cuda:0 (21.3 GiB free), 28-39 on cuda:1 (11.0 GiB free), 40-47 on the CPU"
    )
    lone = SplitPlan(("cuda:0", "cpu"), (0, 1), (GIB, 0))
    assert lone.describe() == "embedding and head on cuda:0 (1.0 GiB free), layers 0 on the CPU"


def test_the_plan_follows_the_estimate_and_leaves_out_empty_parts() -> None:
    info = _info()
    pieces = layer_bytes(info, 4096)
    # the pieces add up to the "layers" estimate for every count
    for n in (0, 4, 10):
        estimate = memory_split(info, 4096, placement="layers", gpu_layers=n).gpu_bytes
        assert abs(pieces.front + sum(pieces.layers[:n]) - estimate) <= 64
    room = pieces.front + 6 * pieces.layers[0] + GPU_MARGIN_BYTES + 1
    plan = plan_split(info, 4096, (16, 16), [("cuda:0", room), ("cuda:1", GPU_MARGIN_BYTES)], 64 * GIB)
    assert plan.devices == ("cuda:0", "cpu") and plan.counts == (6, 4)
    # no context given: the cache the Generator allocates by default, not the model's whole context
    long = _info(context_length=16 * DEFAULT_CACHE_TOKENS)
    pieces = layer_bytes(long, DEFAULT_CACHE_TOKENS)
    gpus = [("cuda:0", pieces.front + 6 * pieces.layers[0] + GPU_MARGIN_BYTES + 1)]
    assert plan_split(long, None, (16, 16), gpus).counts == (6, 4)
    assert plan_split(long, long.context_length, (16, 16), gpus).counts[0] < 6


def test_the_cut_follows_each_layers_own_size(tmp_path) -> None:
    """A dense first layer before mixtures of experts (DeepSeek-V3, GLM-4.5): the first GPU has
    room for the small layer and one big one, the second for one more, the last goes to the CPU;
    equal shares of the layers would have cut after the first layer."""
    info = inspect_model(uneven_moe(tmp_path))
    pieces = layer_bytes(info, 4096)
    small, big = pieces.layers[0], pieces.layers[1]
    assert small * 5 < big and pieces.layers[1:] == (big, big, big)
    slack = small  # room left over on each card, less than a big layer
    gpus = [
        ("cuda:0", pieces.front + small + big + slack + GPU_MARGIN_BYTES),
        ("cuda:1", big + slack + GPU_MARGIN_BYTES),
    ]
    plan = plan_split(info, 4096, (16, 16), gpus, 64 * GIB)
    assert plan.devices == ("cuda:0", "cuda:1", "cpu") and plan.counts == (2, 1, 1)
    assert plan.describe().startswith("layers 0-1 on cuda:0")
    equal = plan_split(replace(info, layer_weights=()), 4096, (16, 16), gpus, 64 * GIB)
    assert equal.counts == (1, 1, 2)


def test_a_split_exl3_model_counts_gpu_layers_as_stored_and_cpu_layers_dense() -> None:
    # 10 layers of 0.5 GiB as stored at 4 bits (2 GiB each dense): a layer read onto a GPU stays
    # packed (engine.parallel.placement.load_split), one in host memory is decoded.
    info = _info(
        quantization="EXL3 4.0 bpw", bits_per_weight=4.0, weight_bytes=5 * GIB, layer_weight_bytes=5 * GIB
    )
    whole = plan_split(info, 4096, (16, 16), [("cuda:0", 8 * GIB), ("cuda:1", 8 * GIB)])
    assert not whole.is_split  # fits the first GPU as stored
    pieces = layer_bytes(info, 4096)
    assert pieces.layers[0] < GIB < 2 * GIB <= pieces.host_layers[0]
    split = plan_split(info, 4096, (16, 16), [("cuda:0", 3 * GIB), ("cuda:1", 3 * GIB)])
    assert split.devices == ("cuda:0", "cuda:1", "cpu") and sum(split.counts) == 10
    assert split.counts[0] >= 2 and split.counts[1] >= 3  # packed layers, not one dense layer each


def test_auto_on_the_command_line(monkeypatch) -> None:
    from engine.cli import build_parser

    parser = build_parser()
    for command in (["generate", "-p", "Hi"], ["bench"], ["serve"]):
        args = parser.parse_args([*command, "-m", "DIR", "--split-layers", "auto"])
        assert is_auto(args.split_layers), command
    assert is_auto(" Auto ") and not is_auto("20,12") and not is_auto(None)
    with pytest.raises(UsageError, match="comma-separated layer counts or auto"):
        parse_split("automatic", 4)
    with pytest.raises(UsageError, match="cannot run with --device cpu"):
        command_line.parallel_model(_args(device="cpu"), None, None)


def test_auto_split_on_the_cpu_gives_the_single_device_logits(tiny_model_factory, monkeypatch) -> None:
    """Two "GPUs" that are the CPU, with free memory for 2 layers and 1 layer: the fourth layer
    spills to the CPU, and the logits are those of the plain load."""
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    info = inspect_model(directory)
    assert info.num_layers == 4
    pieces = layer_bytes(info, min(info.context_length, DEFAULT_CACHE_TOKENS))
    layer = pieces.layers[0]
    fake = [
        ("cpu", GPU_MARGIN_BYTES + pieces.front + 2 * layer + layer // 2),
        ("cpu", GPU_MARGIN_BYTES + layer),
    ]
    monkeypatch.setattr(auto_loading, "free_gpu_memory", lambda: fake)
    monkeypatch.setattr(auto_loading, "available_host_memory", lambda: HOST_MARGIN_BYTES + 4 * layer)
    lines: list[str] = []
    model = auto_loading.load_auto_split(directory, report=lines.append)
    assert lines == ["layers 0-1 on the CPU, 2 on the CPU, 3 on the CPU"]
    assert [isinstance(block, PlacedBlock) for block in model.module.blocks] == [False, False, True, True]
    assert model.layer_devices == [CPU] * 4
    assert_logits_close(step_logits(model), step_logits(load_model(directory, device="cpu")))

    # the command line's path: the same split, from --split-layers auto
    placed, _ = command_line.parallel_model(_args(model=str(directory)), None, None)
    assert [isinstance(block, PlacedBlock) for block in placed.module.blocks] == [False, False, True, True]


def test_the_session_loads_the_automatic_split(tiny_llama_hf, monkeypatch) -> None:
    from engine.parallel.session import ParallelChatSession

    pieces = layer_bytes(inspect_model(tiny_llama_hf), 256)
    fake = [("cpu", GPU_MARGIN_BYTES + pieces.front + pieces.layers[0])]  # one of its two layers
    monkeypatch.setattr(auto_loading, "free_gpu_memory", lambda: fake)
    steps: list[str] = []
    session = ParallelChatSession.load_parallel(
        tiny_llama_hf, split="auto", cache_tokens=256, progress=lambda _f, text: steps.append(text)
    )
    assert [isinstance(block, PlacedBlock) for block in session.model.module.blocks] == [False, True]
    assert "layers 0 on the CPU, 1 on the CPU" in steps  # the chosen split, as a progress step
    with pytest.raises(UsageError, match="needs a GPU, and the device is the CPU"):
        ParallelChatSession.load_parallel(tiny_llama_hf, split="auto", device="cpu")


def _args(**given) -> argparse.Namespace:
    values = dict(model="DIR", device="auto", tp=1, split_layers="auto", gpu_layers=None, experts_on="device")
    return argparse.Namespace(**{**values, **given})


def _info(**fields) -> ModelInfo:
    """A model whose own context is half the Generator's default cache."""
    return model_info(**{"context_length": DEFAULT_CACHE_TOKENS // 2, **fields})
