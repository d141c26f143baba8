"""``--tp N`` and ``--split-layers COUNTS`` for the commands that load a model (generate, bench)."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.commands.common import positive_int
from engine.errors import UsageError

if TYPE_CHECKING:  # the parser is built without loading torch
    from engine.model import LoadedModel
    from engine.options import EngineOptions


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor parallelism over N processes (one GPU each, or the CPU); default 1",
    )
    p.add_argument(
        "--split-layers",
        default=None,
        metavar="COUNTS",
        help="consecutive layers per device, e.g. 20,12 (GPUs 0, 1, ...; the CPU where there are "
        "fewer GPUs than parts)",
    )


def parallel_model(
    args: argparse.Namespace,
    options: EngineOptions | None,
    stack: ExitStack,
    dtype: str | None = None,
    context: int | None = None,
) -> tuple[LoadedModel, EngineOptions | None] | None:
    """The model as ``--tp``/``--split-layers`` ask (the tensor-parallel run closed by ``stack``)
    and the options to run it with, or None where neither is given (the caller loads it as
    usual)."""
    from engine.cache.state import RecurrentState
    from engine.model import load_model, resolve_device

    tp, split = getattr(args, "tp", 1), getattr(args, "split_layers", None)
    if tp == 1 and split is None:
        return None
    if tp > 1 and split is not None:
        raise UsageError("--tp and --split-layers cannot be combined yet")
    if not getattr(args, "model", None):
        raise UsageError("--tp and --split-layers need -m/--model DIR")
    if tp > 1:
        from engine.parallel.launch import start_tensor_parallel

        device = args.device if args.device in ("auto", "cpu", "cuda") else "cuda"
        model, run, report = start_tensor_parallel(
            args.model, tp, device, dtype, context, options=options, exit_on_failure=True
        )
        stack.enter_context(run)  # an error ends the other ranks; a normal exit stops them
        for line in report.lines():
            print(f"trellis: tp {tp}: {line}", file=sys.stderr)
        recurrent = any(isinstance(state, RecurrentState) for state in model.cache_states)
        if recurrent and getattr(args, "ban", None):
            raise UsageError(
                "--ban with --tp needs a model without recurrent layers (its rewind is rank 0's)"
            )
        if options is not None and options.draft != "off" and recurrent:
            # A verify step's rollback restores recurrent state on rank 0 only.
            print(f"trellis: tp {tp}: speculative decoding is off for recurrent layers", file=sys.stderr)
            options = replace(options, draft="off")
        return model, options
    from engine.parallel.placement import default_devices, parse_split, split_layers

    parts = len(split.split(","))
    if args.device in (None, "auto"):
        devices = default_devices(parts)
    else:
        devices = [resolve_device(args.device)] * parts
    model = load_model(args.model, device=str(devices[0]), dtype=dtype, context=context, options=options)
    return split_layers(model, parse_split(split, len(model.module.blocks)), devices), options
