"""``convert``: quantize an HF model directory to EXL3 (engine.convert.pipeline)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.commands.common import ProgressLog, finite_float, non_negative_int, positive_int, probability
from engine.exl3.codebooks import CODEBOOKS


def register(sub) -> None:
    p = sub.add_parser("convert", help="quantize a Hugging Face model directory to EXL3")
    p.add_argument("-i", "--input", required=True, help="source HF model directory")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument(
        "-b", "--bits", type=finite_float(1.0, 8.0), required=True, help="target bits per weight, 1.0..8.0"
    )
    add_head_bits_arg(p, "bits of the output head: 1..8, or 16 (default 6)")
    p.add_argument("--codebook", choices=CODEBOOKS, default="mul1", help="codebook (default mul1)")
    p.add_argument("--cal-rows", type=positive_int, default=250, help="calibration rows (default 250)")
    p.add_argument(
        "--cal-cols", type=positive_int, default=2048, help="tokens per calibration row (default 2048)"
    )
    add_allocation_args(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    add_states_arg(p)
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion")
    p.add_argument("--no-out-scales", action="store_true", help="skip per-output-channel scales")
    add_quantizer_args(p)
    add_tf32_arg(p)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--shard-size", type=positive_int, default=8192, help="shard size in MiB (default 8192)")
    p.add_argument("--report", help="write the per-block error report here (JSON)")
    p.set_defaults(func=run)


# What the converter takes for the head: K bits per weight, or 16 (kept unquantized).
HEAD_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def add_head_bits_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``--head-bits`` (shared with the ``quality`` command), refused at parse time outside
    :data:`HEAD_BITS` rather than when the converter starts."""
    p.add_argument("--head-bits", type=int, choices=HEAD_BITS, default=6, metavar="{1..8,16}", help=help)


def add_states_arg(p: argparse.ArgumentParser) -> None:
    """``--states`` (shared with ``convert-bench``)."""
    from engine.convert.options import STATE_PLACES

    p.add_argument(
        "--states",
        choices=STATE_PLACES,
        default="auto",
        help="where the calibration hidden states live: on the device where they fit (auto, the "
        "default), on the device (device), or in host memory (host: slower; a 70B model's states "
        "take ~34 GB)",
    )


def add_allocation_args(p: argparse.ArgumentParser) -> None:
    """``--allocation`` and ``--sensitivity-rows`` (shared with the ``quality`` command)."""
    from engine.convert.options import ALLOCATIONS

    p.add_argument(
        "--allocation",
        choices=ALLOCATIONS,
        default="sensitivity",
        help="bits per linear: 'sensitivity' measures each linear's cost and spends the budget where "
        "it helps most (default); 'uniform' gives every linear the same K (extra fractional bits "
        "by projection kind)",
    )
    p.add_argument(
        "--sensitivity-rows",
        type=positive_int,
        default=32,
        help="calibration rows of the sensitivity pre-pass (default 32)",
    )


def add_quantizer_args(p: argparse.ArgumentParser) -> None:
    """``--damping``, ``--no-refit``, ``--tune-*`` and ``--sequential`` (shared with the
    ``quality`` command and ``convert-bench``; :func:`quantizer_options` reads them)."""
    p.add_argument(
        "--damping",
        type=finite_float(0.0),
        default=0.01,
        help="Hessian damping, relative to its mean diagonal (default 0.01)",
    )
    p.add_argument(
        "--no-refit",
        action="store_true",
        help="keep the input/output channel scales chosen before LDLQ instead of refitting them to the "
        "quantized weights (least squares in the layer's loss)",
    )
    p.add_argument(
        "--tune-steps",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="after each block is quantized, N Adam steps tune its linears' channel scales to the "
        "unquantized block's output (the bits stay as chosen; 0: off, the default)",
    )
    from engine.convert.options import TUNE_TARGETS

    p.add_argument(
        "--tune-target",
        choices=TUNE_TARGETS,
        default="block",
        help="what the tuning aims at: the unquantized block on the quantized model's inputs "
        "(block, default) or the unquantized model's hidden state (model)",
    )
    p.add_argument(
        "--tune-lr",
        type=finite_float(0.0, low_open=True),
        default=1e-3,
        help="the tuning's learning rate (default 1e-3)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="capture each linear's input Hessian after the linears before it in the block are "
        "quantized (o_proj after q/k/v, gate/up after the attention, down after gate/up): up to "
        "three more partial block forwards per block",
    )
    p.add_argument(
        "--cal-text",
        default="",
        metavar="PATH",
        help="calibration text instead of the shipped one: a UTF-8 file, or a folder whose files are "
        "read in name order (e.g. text from the domain the model will be used in)",
    )
    p.add_argument(
        "--generated-rows",
        type=probability,
        default=0.0,
        metavar="FRACTION",
        help="share of the calibration text rows the model writes itself, each a run of snippets of "
        "the calibration text continued by its own samples (0..1; default 0; the whole model is "
        "loaded on the device while it writes)",
    )


def quantizer_options(args: argparse.Namespace) -> dict:
    """The :class:`~engine.convert.options.ConvertOptions` fields :func:`add_quantizer_args` sets."""
    return {
        "damping": args.damping,
        "refit": not args.no_refit,
        "tune_steps": args.tune_steps,
        "tune_target": args.tune_target,
        "tune_lr": args.tune_lr,
        "sequential": args.sequential,
        "cal_text": args.cal_text,
        "generated_rows": args.generated_rows,
    }


def add_tf32_arg(p: argparse.ArgumentParser) -> None:
    """``--tf32`` / ``--no-tf32`` (shared with the ``quality`` command and ``convert-bench``)."""
    p.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibration forwards and Hessians on TF32 tensor cores (CUDA; default on): a "
        "Llama-3.2-1B shape converts in ~3.0 min on an H200 instead of ~4.6 in fp32, at the same "
        "quality (SmolLM2 4.0 bpw, 3 seeds: mean KL 0.0946 vs 0.0947); --no-tf32 for fp32",
    )


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.convert.checkpoints import WORK_DIR, finished_blocks
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    args.options.configure_kernels()  # the Viterbi and the calibration run the process's extension
    options = ConvertOptions(
        bits=args.bits,
        head_bits=args.head_bits,
        codebook=args.codebook,
        cal_rows=args.cal_rows,
        cal_cols=args.cal_cols,
        out_scales=not args.no_out_scales,
        seed=args.seed,
        shard_size_mb=args.shard_size,
        device=args.device,
        states=args.states,
        allocation=args.allocation,
        sensitivity_rows=args.sensitivity_rows,
        tf32=args.tf32,
        **quantizer_options(args),
    )
    shown = ProgressLog()
    try:
        report = convert_model(
            args.input, args.output, options, resume=args.resume, log=shown.log, progress=shown.progress
        )
    except KeyboardInterrupt:
        shown.close()
        work = Path(args.output) / WORK_DIR
        done = finished_blocks(work)
        print(
            f"interrupted: {done} finished block(s) are saved in {work}; the same command with "
            "--resume continues from there",
            file=sys.stderr,
        )
        return 130
    finally:
        shown.close()
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(asdict(report), f, indent=1)
    return 0
