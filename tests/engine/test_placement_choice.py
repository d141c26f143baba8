"""One placement choice and its loader for the command line and the app: which choices are refused
(in each front end's words), and what each choice loads. The "GPUs" here are the CPU (fake
free-memory figures, the GPU of ``--gpu-layers`` replaced by the CPU); the tensor-parallel start
is replaced by a recorder (real runs: test_tensor_parallel.py, test_parallel_cli.py)."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch
from parallel_cases import assert_logits_close, step_logits

from engine.cache.state import RecurrentState
from engine.errors import UsageError
from engine.inspect import inspect_model
from engine.model import load_model
from engine.options import EngineOptions
from engine.parallel import auto_loading, command_line, gpu_layers, placement_choice
from engine.parallel.auto_split import GPU_MARGIN_BYTES, HOST_MARGIN_BYTES
from engine.parallel.placement import PlacedBlock
from engine.parallel.placement_choice import APP, COMMAND_LINE, PlacementChoice, load_placed
from engine.parallel.sharding import ShardReport
from engine.placement_memory import layer_bytes

CPU = torch.device("cpu")
DRAFT = EngineOptions(draft="ngram")


def _placed_kinds(model) -> list[bool]:
    return [isinstance(block, PlacedBlock) for block in model.module.blocks]


# -- refusals -------------------------------------------------------------------------------------

COMBINATIONS = [
    ({"tensor_parallel": 2, "split_layers": "2,2"}, COMMAND_LINE.tp_with_split),
    ({"tensor_parallel": 2, "split_layers": "auto"}, COMMAND_LINE.tp_with_split),
    ({"gpu_layers": 2, "tensor_parallel": 2}, COMMAND_LINE.gpu_layers_with_others),
    ({"gpu_layers": 2, "split_layers": "2,2"}, COMMAND_LINE.gpu_layers_with_others),
    ({"experts_on": "cpu", "tensor_parallel": 2}, COMMAND_LINE.experts_with_others),
    ({"experts_on": "cpu", "split_layers": "2,2"}, COMMAND_LINE.experts_with_others),
    ({"experts_on": "cpu", "gpu_layers": 2}, COMMAND_LINE.experts_with_others),
]


@pytest.mark.parametrize(("given", "message"), COMBINATIONS)
def test_combinations_are_refused_naming_the_flags_or_one_at_a_time(given, message) -> None:
    with pytest.raises(UsageError) as caught:
        PlacementChoice(**given, wording=COMMAND_LINE)
    assert str(caught.value) == message and message.startswith("--")
    with pytest.raises(UsageError, match="^a model is split .*: one at a time$"):
        PlacementChoice(**given)  # the app's words


@pytest.mark.parametrize(
    ("given", "line", "app"),
    [
        ({"gpu_layers": 2}, "--gpu-layers puts layers on a GPU", "the first layers on the GPU need a GPU"),
        ({"split_layers": "auto"}, "--split-layers auto spreads", "splitting across GPUs automatically"),
        ({"split_layers": " Auto "}, "--split-layers auto spreads", "splitting across GPUs automatically"),
    ],
)
def test_a_gpu_placement_on_the_cpu_is_refused(given, line, app) -> None:
    with pytest.raises(UsageError, match=f"^{line}.*--device cpu$"):
        PlacementChoice(**given, device="cpu", wording=COMMAND_LINE)
    with pytest.raises(UsageError, match=f"^{app}.*the device is the CPU$"):
        PlacementChoice(**given, device="cpu", wording=APP)
    PlacementChoice(**given, device="cuda:1")  # on a GPU it is a choice


def test_only_a_choice_of_nothing_is_plain() -> None:
    assert PlacementChoice().is_plain and PlacementChoice(tensor_parallel=1, device="cpu").is_plain
    spread = [{"tensor_parallel": 2}, {"split_layers": "1,3"}, {"gpu_layers": 0}, {"experts_on": "cpu"}]
    assert not any(PlacementChoice(**given).is_plain for given in spread)


# -- what each choice loads -----------------------------------------------------------------------


def test_a_plain_choice_loads_the_whole_model_on_its_device(tiny_model_factory) -> None:
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    steps: list[str] = []
    placed = load_placed(
        directory, PlacementChoice(device="cpu"), options=DRAFT, progress=lambda _f, s: steps.append(s)
    )
    assert placed.run is None and placed.options is DRAFT
    assert placed.model.device == CPU and placed.model.layer_devices is None
    assert not any(_placed_kinds(placed.model)) and placed.model.experts_device is None
    assert steps and steps[0].startswith("loading LlamaForCausalLM")
    assert_logits_close(step_logits(placed.model), step_logits(load_model(directory, device="cpu")))


def test_experts_on_the_cpu_keep_the_routed_experts_in_host_memory(tiny_model_factory) -> None:
    directory = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    placed = load_placed(directory, PlacementChoice(experts_on="cpu", device="cpu"), dtype="float32")
    assert placed.run is None and placed.model.experts_device == CPU
    assert placed.model.module.dynamic_decode == "experts-in-host-memory"
    assert_logits_close(step_logits(placed.model), step_logits(load_model(directory, device="cpu")))


def test_gpu_layers_put_the_first_layers_on_the_gpu_and_the_rest_on_the_cpu(
    tiny_model_factory, monkeypatch
) -> None:
    monkeypatch.setattr(gpu_layers, "the_gpu", lambda: CPU)  # the stand-in for GPU 0
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    placed = load_placed(directory, PlacementChoice(gpu_layers=3))
    assert _placed_kinds(placed.model) == [False, False, False, True] and placed.run is None
    assert placed.model.layer_devices == [CPU] * 4
    with pytest.raises(UsageError, match="--gpu-layers 5 is out of range"):
        load_placed(directory, PlacementChoice(gpu_layers=5))


def test_auto_split_fills_the_gpus_by_free_memory_and_reports_the_split(
    tiny_model_factory, monkeypatch, capsys
) -> None:
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    pieces = layer_bytes(inspect_model(directory), 256)
    layer = pieces.layers[0]
    fake_gpu = ("cpu", GPU_MARGIN_BYTES + pieces.front + 2 * layer + layer // 2)  # holds 2 layers
    monkeypatch.setattr(auto_loading, "free_gpu_memory", lambda: [fake_gpu])
    monkeypatch.setattr(auto_loading, "available_host_memory", lambda: HOST_MARGIN_BYTES + 4 * layer)
    steps: list[str] = []
    placed = load_placed(
        directory, PlacementChoice(split_layers="auto"), context=256, progress=lambda _f, s: steps.append(s)
    )
    assert _placed_kinds(placed.model) == [False, False, True, True]
    assert "layers 0-1 on the CPU, 2-3 on the CPU" in steps
    assert "trellis: split-layers auto: layers 0-1 on the CPU" in capsys.readouterr().err


def test_split_layers_put_each_count_on_its_device(tiny_model_factory, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto": the CPU for every part
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    for device in ("auto", "cpu"):
        placed = load_placed(directory, PlacementChoice(split_layers="1,3", device=device))
        assert _placed_kinds(placed.model) == [False, True, True, True] and placed.run is None
        assert placed.model.layer_devices == [CPU] * 4
    with pytest.raises(UsageError, match="add up to the model's 4 layers"):
        load_placed(directory, PlacementChoice(split_layers="1,1", device="cpu"))


class _RecordedStart:
    """Stands in for ``start_tensor_parallel``: records its arguments, returns ``model`` and a run
    that records how it was closed."""

    def __init__(self, model, report: ShardReport | None = None) -> None:
        self.model, self.report, self.calls, self.closed = model, report or ShardReport(), [], []

    def __call__(self, directory, world, device, dtype, context, **kwargs):
        self.calls.append((world, device, dtype, context, kwargs))
        run = self

        class Run:
            def close(self, abort: bool = False) -> None:
                run.closed.append(abort)

            def __enter__(self):
                return self

            def __exit__(self, kind, *_) -> None:
                self.close(abort=kind is not None)

        return self.model, Run(), self.report


@pytest.fixture
def recurrent_llama(tiny_model_factory):
    """A tiny Llama whose cache says one layer keeps recurrent state (what decides the draft)."""
    model = load_model(tiny_model_factory("LlamaForCausalLM")[0], device="cpu")
    return replace(model, cache_states=[RecurrentState({"state": (4,)})] * 4)


def test_tensor_parallel_starts_the_ranks_and_turns_the_draft_off_for_recurrent_layers(
    recurrent_llama, monkeypatch, capsys
) -> None:
    start = _RecordedStart(recurrent_llama, ShardReport(replicated={"Mamba2": [0, 2]}))
    monkeypatch.setattr(placement_choice, "start_tensor_parallel", start)
    choice = PlacementChoice(tensor_parallel=2, device="cuda:1")
    placed = load_placed("DIR", choice, context=64, options=DRAFT)
    assert placed.model is recurrent_llama and placed.run is not None and not start.closed
    assert start.calls == [(2, "cuda", None, 64, {"options": DRAFT, "exit_on_failure": False})]
    assert placed.options == replace(DRAFT, draft="off")
    err = capsys.readouterr().err
    assert "trellis: tp 2: Mamba2 layers [0, 2] replicated on every rank" in err
    assert "trellis: tp 2: speculative decoding is off for recurrent layers" in err

    plain = replace(recurrent_llama, cache_states=None)  # attention only: the draft stays
    monkeypatch.setattr(placement_choice, "start_tensor_parallel", _RecordedStart(plain))
    placed = load_placed("DIR", PlacementChoice(tensor_parallel=2, device="cpu"), options=DRAFT)
    assert placed.options is DRAFT


def test_a_failure_after_the_ranks_start_ends_them(recurrent_llama, monkeypatch) -> None:
    class BrokenReport(ShardReport):
        def lines(self) -> list[str]:
            raise RuntimeError("report failed")

    start = _RecordedStart(recurrent_llama, BrokenReport())
    monkeypatch.setattr(placement_choice, "start_tensor_parallel", start)
    with pytest.raises(RuntimeError, match="report failed"):
        load_placed("DIR", PlacementChoice(tensor_parallel=2, device="cpu"))
    assert start.closed == [True]  # aborted: the other ranks end at once


# -- the command line's side ----------------------------------------------------------------------


def _args(**given) -> argparse.Namespace:
    values = dict(model="DIR", device="cpu", tp=1, split_layers=None, gpu_layers=None, experts_on="device")
    return argparse.Namespace(**{**values, **given})


def test_the_command_line_builds_the_choice_from_its_flags() -> None:
    choice = command_line.placement_choice(_args(split_layers="2,2", device="cuda"))
    assert choice == PlacementChoice(split_layers="2,2", device="cuda", wording=COMMAND_LINE)
    bare = argparse.Namespace(model="DIR")  # a command without the placement flags
    assert command_line.placement_choice(bare).is_plain
    assert command_line.parallel_model(bare, None, None) is None


def test_the_command_line_runs_the_ranks_in_its_stack_and_refuses_ban_with_recurrent_layers(
    recurrent_llama, monkeypatch
) -> None:
    start = _RecordedStart(recurrent_llama)
    monkeypatch.setattr(placement_choice, "start_tensor_parallel", start)
    with ExitStack() as stack:
        model, options = command_line.parallel_model(_args(tp=2), DRAFT, stack, "float32")
        assert model is recurrent_llama and options.draft == "off" and start.closed == []
    assert start.calls[0][4]["exit_on_failure"] is True and start.closed == [False]
    with pytest.raises(UsageError, match="--ban with --tp needs a model without recurrent layers"):
        with ExitStack() as stack:
            command_line.parallel_model(_args(tp=2, ban=["x"]), None, stack)
    assert start.closed[-1] is True  # the refusal ended the ranks
