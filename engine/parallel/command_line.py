"""``--tp N``, ``--split-layers COUNTS|auto``, ``--gpu-layers N`` and ``--experts-on cpu`` for the
commands that load a model (generate, bench; serve takes all but ``--tp``)."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from typing import TYPE_CHECKING

from engine.commands.common import cache_bits, positive_int
from engine.errors import UsageError

if TYPE_CHECKING:  # the parser is built without loading torch
    from engine.model import LoadedModel
    from engine.options import EngineOptions
    from engine.parallel.placement_choice import PlacementChoice


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor parallelism over N processes (one GPU each, or the CPU); default 1",
    )
    add_placement_args(p)


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """The options that place one model's parts on different devices (GPUs, or host memory run by
    the CPU), in one process."""
    p.add_argument(
        "--split-layers",
        default=None,
        metavar="COUNTS",
        help="consecutive layers per device, e.g. 20,12 (GPUs 0, 1, ...; the CPU where there are "
        "fewer GPUs than parts), or auto: as many as each GPU's free memory holds, the rest on the CPU",
    )
    p.add_argument(
        "--gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="the first N layers on the GPU, the rest on the CPU (a model larger than the GPU)",
    )
    p.add_argument(
        "--experts-on",
        choices=("device", "cpu"),
        default="device",
        help="cpu: the routed experts of a mixture-of-experts model in host memory, computed on the "
        "CPU; attention, router and shared experts on the device (default: device)",
    )


def parallel_model(
    args: argparse.Namespace,
    options: EngineOptions | None,
    stack: ExitStack | None,
    dtype: str | None = None,
    context: int | None = None,
) -> tuple[LoadedModel, EngineOptions | None] | None:
    """The model as ``--tp``/``--split-layers``/``--gpu-layers``/``--experts-on`` ask (the
    tensor-parallel run closed by ``stack``, which a command without ``--tp`` may leave None) and
    the options to run it with, or None where none is given (the caller loads it as usual)."""
    from engine.parallel.placement_choice import has_recurrent_layers, load_placed

    choice = placement_choice(args)
    if choice.is_plain:
        return None
    if not getattr(args, "model", None):
        raise UsageError("--tp, --split-layers, --gpu-layers and --experts-on need -m/--model DIR")
    bits = cache_bits(args) if hasattr(args, "cache_bits") else (16, 16)
    placed = load_placed(
        args.model,
        choice,
        dtype=dtype,
        context=context,
        cache_bits=bits,
        options=options,
        exit_on_failure=True,  # a dead rank ends the command
    )
    if placed.run is not None:
        stack.enter_context(placed.run)  # an error ends the other ranks; a normal exit stops them
        if getattr(args, "ban", None) and has_recurrent_layers(placed.model):
            raise UsageError(
                "--ban with --tp needs a model without recurrent layers (its rewind is rank 0's)"
            )
    return placed.model, placed.options


def placement_choice(args: argparse.Namespace) -> PlacementChoice:
    """The placement the command line asks for (a command without one of the options leaves it
    at its default); refused here where it cannot be loaded."""
    from engine.parallel.placement_choice import COMMAND_LINE, PlacementChoice

    return PlacementChoice(
        tensor_parallel=getattr(args, "tp", 1),
        split_layers=getattr(args, "split_layers", None),
        gpu_layers=getattr(args, "gpu_layers", None),
        experts_on=getattr(args, "experts_on", "device"),
        device=getattr(args, "device", "auto"),
        wording=COMMAND_LINE,
    )
