"""Layer split: consecutive layers on two "devices" (both the CPU here; the path is the one a GPU
pair or a GPU and the CPU take) give the single-device logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_cases import assert_logits_close, greedy_jobs, step_logits

from engine.errors import UsageError
from engine.model import load_model
from engine.parallel.placement import PlacedBlock, parse_split, split_layers

HYBRIDS = Path(__file__).parent.parent / "data" / "tiny-hybrids"
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("variant", "counts"),
    [("LlamaForCausalLM", [3, 1]), ("Qwen3MoeForCausalLM", [2, 2]), ("hybrid", [2, 2])],
)
def test_layer_split_matches_one_device(variant, counts, tiny_model_factory) -> None:
    directory = HYBRIDS / "qwen3_5" if variant == "hybrid" else tiny_model_factory(variant)[0]
    reference_logits = step_logits(load_model(directory, device="cpu"))
    reference_tokens, _ = greedy_jobs(load_model(directory, device="cpu"))
    split = split_layers(load_model(directory, device="cpu"), counts, [CPU, CPU])
    placed = [isinstance(block, PlacedBlock) for block in split.module.blocks]
    assert placed == [False] * counts[0] + [True] * counts[1]
    assert split.layer_devices == [CPU] * sum(counts)
    assert_logits_close(step_logits(split), reference_logits)
    tokens, cached = greedy_jobs(split)
    assert cached > 0 and tokens == reference_tokens


def test_placed_block_moves_the_step_once_per_device(tiny_model_factory) -> None:
    from engine.modules.batch import BatchLayout
    from engine.parallel.placement import batch_on

    batch = BatchLayout([], torch.arange(3), torch.arange(3))
    assert batch_on(batch, CPU) is batch  # already there: nothing moved
    meta = torch.device("meta")
    moved = batch_on(batch, meta)
    assert moved.positions.device == meta and batch_on(batch, meta) is moved


def test_parse_split_checks_the_counts() -> None:
    assert parse_split("20,12", 32) == [20, 12]
    with pytest.raises(UsageError, match="add up to the model's 32 layers"):
        parse_split("20,10", 32)
    with pytest.raises(UsageError, match="comma-separated layer counts"):
        parse_split("20;12", 32)
    with pytest.raises(UsageError, match="counts >= 0"):
        parse_split("40,-8", 32)


def test_each_layer_is_read_straight_onto_its_device(tiny_model_factory) -> None:
    """A split reads each layer onto its own device while loading (no device holds more than its
    part; the model's device is never given the others' layers), and load_split matches the
    plain model's logits."""
    from engine.parallel.placement import load_split, model_layer_count

    directory = tiny_model_factory("LlamaForCausalLM")[0]
    layers = model_layer_count(directory)
    per_layer = [torch.device("cpu")] + [torch.device("meta")] * (layers - 1)
    model = load_model(directory, device="cpu", dtype="float32", layer_devices=per_layer)
    for block, device in zip(model.module.blocks, per_layer):
        assert {p.device for p in block.parameters()} == {device}
    assert {p.device.type for p in model.module.embedding.parameters()} == {"cpu"}
    with pytest.raises(UsageError, match="layer devices"):
        load_model(directory, device="cpu", layer_devices=per_layer[:-1])

    split = load_split(directory, [1, layers - 1], [torch.device("cpu")] * 2, dtype="float32")
    plain = load_model(directory, device="cpu", dtype="float32")
    assert isinstance(split.module.blocks[-1], PlacedBlock)
    assert_logits_close(step_logits(split), step_logits(plain))
