"""``--tp N``, ``--split-layers COUNTS|auto``, ``--gpu-layers N`` and ``--experts-on cpu`` for the
commands that load a model (generate, bench; serve takes all but ``--tp``)."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.commands.common import positive_int
from engine.errors import UsageError
from engine.parallel.auto_split import is_auto

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
    from engine.cache.state import RecurrentState
    from engine.model import load_model, resolve_device

    tp, split = getattr(args, "tp", 1), getattr(args, "split_layers", None)
    gpu_layers, experts_on = getattr(args, "gpu_layers", None), getattr(args, "experts_on", "device")
    if tp == 1 and split is None and gpu_layers is None and experts_on == "device":
        return None
    if tp > 1 and split is not None:
        raise UsageError("--tp and --split-layers cannot be combined yet")
    if gpu_layers is not None and (tp > 1 or split is not None):
        raise UsageError("--gpu-layers is a layer split of its own: it takes neither --tp nor --split-layers")
    if experts_on != "device" and (tp > 1 or split is not None or gpu_layers is not None):
        raise UsageError("--experts-on cpu cannot be combined with --tp, --split-layers or --gpu-layers yet")
    if not getattr(args, "model", None):
        raise UsageError("--tp, --split-layers, --gpu-layers and --experts-on need -m/--model DIR")
    if experts_on != "device":
        model = load_model(
            args.model,
            device=args.device,
            dtype=dtype,
            context=context,
            options=options,
            experts_on=experts_on,
        )
        return model, options
    if gpu_layers is not None:
        from engine.parallel.gpu_layers import load_gpu_layers

        if args.device == "cpu":
            raise UsageError("--gpu-layers puts layers on a GPU: it cannot run with --device cpu")
        gpu = resolve_device(args.device) if str(args.device).startswith("cuda") else None
        model = load_gpu_layers(args.model, gpu_layers, gpu, dtype=dtype, context=context, options=options)
        return model, options
    if is_auto(split):
        from engine.commands.common import cache_bits
        from engine.parallel.auto_loading import load_auto_split

        if args.device == "cpu":
            raise UsageError(
                "--split-layers auto spreads a model over the GPUs: it cannot run with --device cpu"
            )
        bits = cache_bits(args) if hasattr(args, "cache_bits") else (16, 16)
        model = load_auto_split(args.model, dtype, context, bits, options)
        return model, options
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
    from engine.parallel.placement import default_devices, load_split, model_layer_count, parse_split

    counts = parse_split(split, model_layer_count(args.model))
    if args.device in (None, "auto"):
        devices = default_devices(len(counts))
    else:
        devices = [resolve_device(args.device)] * len(counts)
    return load_split(args.model, counts, devices, dtype, context, options), options
