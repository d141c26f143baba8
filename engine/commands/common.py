"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("-m", "--model", required=required, help="model directory (Hugging Face layout)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="compute dtype")


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-bits",
        default=None,
        metavar="K[,V]",
        help="KV cache bits for keys[,values]: 2..8, or 16 for unquantized (default)",
    )


def cache_bits(args: argparse.Namespace) -> tuple[int, int]:
    from engine.cache.paged import parse_cache_bits

    try:
        return parse_cache_bits(args.cache_bits)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"error: --ids must be comma-separated integers, got '{text}'") from None


def stderr_progress(fraction: float, message: str) -> None:
    """A one-line progress indicator on stderr (stdout stays clean for --json)."""
    width = 30
    filled = int(fraction * width)
    end = "\n" if fraction >= 1.0 else ""
    print(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {fraction * 100:5.1f}% {message:<40}",
        end=end,
        file=sys.stderr,
    )


class ProgressLog:
    """Log lines on stdout with a :func:`stderr_progress` bar kept under them: each line first
    clears the bar and then redraws it, so a terminal shows the log scrolling above one bar."""

    def __init__(self) -> None:
        self._bar: tuple[float, str] | None = None

    def log(self, message: str) -> None:
        if self._bar is not None:
            print("\r" + " " * 90 + "\r", end="", file=sys.stderr, flush=True)
        print(message, flush=True)
        if self._bar is not None:
            stderr_progress(*self._bar)

    def progress(self, fraction: float, message: str) -> None:
        self._bar = None if fraction >= 1.0 else (fraction, message)
        stderr_progress(fraction, message)

    def close(self) -> None:
        """End an unfinished bar's line, so what is printed next (an error) starts on its own."""
        if self._bar is not None:
            print(file=sys.stderr, flush=True)
            self._bar = None


def run_alone(register: Callable, command: str, argv: Sequence[str] | None = None) -> int:
    """Run one subcommand without the rest of the CLI (whose other commands need the app's full
    dependency set): ``python -m engine.commands.<module> ARGS`` on a GPU host, for instance."""
    parser = argparse.ArgumentParser(prog=f"python -m engine.commands.{command.replace('-', '_')}")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)
