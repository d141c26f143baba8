"""``python -m engine``: the engine's command line.

Each subcommand lives in its own module under ``engine/commands/`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to the function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.errors import EngineError

# Modules under engine.commands, one per subcommand family. Order is the order in --help.
COMMAND_MODULES = [
    "generate",
    "logits",
    "ppl",
    "bench",
    "synthetic",
    "cache_capacity",
    "import_gguf",
    "download",
    "search",
    "constrain_eval",
    "build_ext",
    "bench_kernels",
    "bench_attention",
    "bench_sampler",
    "bench_device_sampler",
    "profile_step",
    "convert",
    "quality",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Trellis inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"engine.commands.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
