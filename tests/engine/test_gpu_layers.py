"""``--gpu-layers N``: the layer split ``--split-layers N,REST`` over (GPU, CPU), loaded so that only
the GPU's part goes there. Here a "GPU" is a stand-in device: the CPU itself (numbers), or
``meta`` (placement)."""

from __future__ import annotations

import argparse

import pytest
import torch
from parallel_cases import assert_logits_close, greedy_jobs, step_logits

from engine.errors import UsageError
from engine.model import load_model
from engine.parallel import command_line
from engine.parallel.gpu_layers import gpu_layer_counts, load_gpu_layers
from engine.parallel.placement import PlacedBlock, split_layers

CPU = torch.device("cpu")


def test_gpu_layers_is_the_split_of_n_and_the_rest(tiny_model_factory) -> None:
    directory = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    ours = load_gpu_layers(directory, 3, gpu=CPU)
    theirs = split_layers(load_model(directory, device="cpu"), [3, 1], [CPU, CPU])
    assert ours.layer_devices == theirs.layer_devices
    kinds = [isinstance(b, PlacedBlock) for b in ours.module.blocks]
    assert kinds == [isinstance(b, PlacedBlock) for b in theirs.module.blocks] == [False] * 3 + [True]
    assert_logits_close(step_logits(ours), step_logits(theirs))
    assert greedy_jobs(ours, tokens=16)[0] == greedy_jobs(theirs, tokens=16)[0]


@pytest.mark.parametrize("n", [0, 2, 4])
def test_only_the_first_layers_and_the_ends_go_to_the_gpu(n, tiny_model_factory) -> None:
    """``meta`` stands for the GPU: the embedding, head, final norm and the first ``n`` layers
    move there, the other layers stay in host memory."""
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    meta = torch.device("meta")
    model = load_gpu_layers(directory, n, gpu=meta)
    assert model.device == meta and model.dtype == torch.bfloat16  # the GPU's dtype
    assert model.layer_devices == [meta] * n + [CPU] * (4 - n)
    module = model.module
    for i, block in enumerate(module.blocks):
        expected = "meta" if i < n else "cpu"
        assert {t.device.type for t in [*block.parameters(), *block.buffers()]} == {expected}
    assert module.embedding.weight.device == meta and module.lm_head.weight.device == meta
    assert len(module.blocks) == 4


def test_gpu_layers_out_of_range_is_refused() -> None:
    assert gpu_layer_counts(0, 4) == [0, 4] and gpu_layer_counts(4, 4) == [4, 0]
    for n in (-1, 5):
        with pytest.raises(UsageError, match=rf"--gpu-layers {n} is out of range: the model has 4 layers"):
            gpu_layer_counts(n, 4)


def _args(**given) -> argparse.Namespace:
    values = dict(model="DIR", device="auto", tp=1, split_layers=None, gpu_layers=None, experts_on="device")
    return argparse.Namespace(**{**values, **given})


def test_gpu_layers_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="--gpu-layers needs a GPU and none was found"):
        command_line.parallel_model(_args(gpu_layers=2), None, None)
    with pytest.raises(UsageError, match="cannot run with --device cpu"):
        command_line.parallel_model(_args(gpu_layers=2, device="cpu"), None, None)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gpu_layers": 2, "split_layers": "2,2"}, "takes neither --tp nor --split-layers"),
        ({"gpu_layers": 2, "tp": 2}, "takes neither --tp nor --split-layers"),
        ({"experts_on": "cpu", "gpu_layers": 2}, "--experts-on cpu cannot be combined"),
        ({"experts_on": "cpu", "model": None}, "need -m/--model DIR"),
    ],
)
def test_placement_options_that_do_not_combine(given, message) -> None:
    with pytest.raises(UsageError, match=message):
        command_line.parallel_model(_args(**given), None, None)
