"""Where one model's parts go, as a front end asks for it, and the one loader that carries it out.

A :class:`PlacementChoice` is tensor-parallel ranks, a layer split (explicit counts or ``auto``),
the first N layers on the GPU, or the routed experts in host memory — one of these at a time — or
none of them (a plain load). The command line builds it from ``--tp``/``--split-layers``/
``--gpu-layers``/``--experts-on`` (``engine.parallel.command_line``), the app's session from
keywords (``engine.parallel.session``); both load through :func:`load_placed`. A choice that
cannot be loaded is refused when it is made, in the words of the front end that made it
(:data:`COMMAND_LINE` names its flags, :data:`APP` what the user picked).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine.cache.state import RecurrentState
from engine.errors import UsageError
from engine.model import LoadedModel, load_model, resolve_device
from engine.options import EngineOptions
from engine.parallel.auto_loading import load_auto_split, report_to_stderr
from engine.parallel.auto_split import is_auto
from engine.parallel.gpu_layers import load_gpu_layers
from engine.parallel.launch import TensorParallelRun, start_tensor_parallel
from engine.parallel.placement import default_devices, load_split, model_layer_count, parse_split

Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class Wording:
    """A front end's messages for the choices that cannot be loaded."""

    tp_with_split: str
    gpu_layers_with_others: str
    experts_with_others: str
    gpu_layers_on_cpu: str
    auto_split_on_cpu: str


COMMAND_LINE = Wording(
    tp_with_split="--tp and --split-layers cannot be combined yet",
    gpu_layers_with_others=(
        "--gpu-layers is a layer split of its own: it takes neither --tp nor --split-layers"
    ),
    experts_with_others="--experts-on cpu cannot be combined with --tp, --split-layers or --gpu-layers yet",
    gpu_layers_on_cpu="--gpu-layers puts layers on a GPU: it cannot run with --device cpu",
    auto_split_on_cpu="--split-layers auto spreads a model over the GPUs: it cannot run with --device cpu",
)
# The app offers one way of spreading a model at a time, so one message covers every combination.
_ONE_AT_A_TIME = "a model is split across ranks, by layers, by GPU layers or by experts: one at a time"
APP = Wording(
    tp_with_split=_ONE_AT_A_TIME,
    gpu_layers_with_others=_ONE_AT_A_TIME,
    experts_with_others=_ONE_AT_A_TIME,
    gpu_layers_on_cpu="the first layers on the GPU need a GPU, and the device is the CPU",
    auto_split_on_cpu="splitting across GPUs automatically needs a GPU, and the device is the CPU",
)


@dataclass(frozen=True)
class PlacementChoice:
    """``tensor_parallel``: ranks, one GPU each (or the CPU; 1: one process); ``split_layers``:
    consecutive layers per device (``"20,12"``) or ``"auto"`` (None: no layer split);
    ``gpu_layers``: the first N layers on the GPU, the rest on the CPU; ``experts_on``: ``"cpu"``
    keeps a mixture's routed experts in host memory; ``device``: ``auto``, ``cpu``, ``cuda`` or
    ``cuda:N``; ``wording``: whose words a refusal uses. Made only where it can be loaded: a
    combination, or a GPU placement on the CPU, raises a :class:`UsageError` here."""

    tensor_parallel: int = 1
    split_layers: str | None = None
    gpu_layers: int | None = None
    experts_on: str = "device"
    device: str | None = "auto"
    wording: Wording = APP

    def __post_init__(self) -> None:
        tp, split, words = self.tensor_parallel > 1, self.split_layers is not None, self.wording
        if tp and split:
            raise UsageError(words.tp_with_split)
        if self.gpu_layers is not None and (tp or split):
            raise UsageError(words.gpu_layers_with_others)
        if self.experts_on != "device" and (tp or split or self.gpu_layers is not None):
            raise UsageError(words.experts_with_others)
        if self.gpu_layers is not None and self.device == "cpu":
            raise UsageError(words.gpu_layers_on_cpu)
        if is_auto(self.split_layers) and self.device == "cpu":
            raise UsageError(words.auto_split_on_cpu)

    @property
    def is_plain(self) -> bool:
        """Whether nothing is spread: the whole model on one device."""
        return (
            self.tensor_parallel <= 1
            and self.split_layers is None
            and self.gpu_layers is None
            and self.experts_on == "device"
        )


@dataclass(frozen=True)
class PlacedModel:
    """What :func:`load_placed` gives: the model, the options to run it with, and the
    tensor-parallel run whose other ranks the caller ends (None for one process)."""

    model: LoadedModel
    options: EngineOptions | None
    run: TensorParallelRun | None = None


def load_placed(
    directory: str | Path,
    choice: PlacementChoice,
    *,
    dtype: str | None = None,
    context: int | None = None,
    cache_bits: tuple[int, int] = (16, 16),
    options: EngineOptions | None = None,
    progress: Progress | None = None,
    exit_on_failure: bool = False,
) -> PlacedModel:
    """The model of ``directory`` placed as ``choice`` says. ``context``: the cache's tokens and
    the RoPE context (None: the defaults); ``cache_bits``: the cache's (K, V) bits, which an
    automatic split counts; ``exit_on_failure``: a tensor-parallel run ends this process when a
    rank dies (a command line's choice; the app survives it)."""
    if choice.tensor_parallel > 1:
        return _start_ranks(directory, choice, dtype, context, options, exit_on_failure)
    device = choice.device
    if choice.gpu_layers is not None:
        gpu = resolve_device(device) if str(device).startswith("cuda") else None  # None: GPU 0
        model = load_gpu_layers(directory, choice.gpu_layers, gpu, dtype, context, options, progress)
        return PlacedModel(model, options)
    if is_auto(choice.split_layers):

        def report(line: str) -> None:  # the chosen split: on stderr, and as a progress step
            report_to_stderr(line)
            if progress:
                progress(0.0, line)

        model = load_auto_split(directory, dtype, context, cache_bits, options, progress, report)
        return PlacedModel(model, options)
    if choice.split_layers is not None:
        counts = parse_split(choice.split_layers, model_layer_count(directory))
        if device in (None, "auto"):
            devices = default_devices(len(counts))
        else:
            devices = [resolve_device(device)] * len(counts)
        return PlacedModel(load_split(directory, counts, devices, dtype, context, options, progress), options)
    model = load_model(
        directory,
        device=device,
        dtype=dtype,
        context=context,
        progress=progress,
        options=options,
        experts_on=choice.experts_on,
    )
    return PlacedModel(model, options)


def _start_ranks(
    directory: str | Path,
    choice: PlacementChoice,
    dtype: str | None,
    context: int | None,
    options: EngineOptions | None,
    exit_on_failure: bool,
) -> PlacedModel:
    """The tensor-parallel run of ``choice``, its report on stderr."""
    tp = choice.tensor_parallel
    kind = choice.device if choice.device in ("auto", "cpu", "cuda") else "cuda"  # cuda:N: from GPU 0
    model, run, report = start_tensor_parallel(
        directory, tp, kind, dtype, context, options=options, exit_on_failure=exit_on_failure
    )
    try:
        for line in report.lines():
            print(f"trellis: tp {tp}: {line}", file=sys.stderr)
        return PlacedModel(model, without_recurrent_draft(model, options, tp), run)
    except BaseException:
        run.close(abort=True)
        raise


def has_recurrent_layers(model: LoadedModel) -> bool:
    """Whether any layer of ``model`` keeps recurrent state (whose rollback, in a tensor-parallel
    run, is rank 0's only)."""
    return any(isinstance(state, RecurrentState) for state in model.cache_states or [])


def without_recurrent_draft(
    model: LoadedModel, options: EngineOptions | None, tp: int
) -> EngineOptions | None:
    """``options`` with speculative decoding off where a tensor-parallel model has recurrent
    layers: a verify step's rollback restores recurrent state on rank 0 only."""
    if options is not None and options.draft != "off" and has_recurrent_layers(model):
        print(f"trellis: tp {tp}: speculative decoding is off for recurrent layers", file=sys.stderr)
        return replace(options, draft="off")
    return options
