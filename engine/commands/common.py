"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.errors import InputNotFoundError, UsageError


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number of at least ``minimum`` (the message names the bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"whole number >= {minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def finite_float(
    low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number within ``low``..``high`` (None: no bound on that
    side; ``*_open``: the bound itself is excluded). ``float()`` alone takes "nan" and "inf",
    which then pass or fail comparisons silently."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    if low is not None and high is not None:
        allowed = f"a number in {left}{low:g}, {high:g}{right}"
    elif low is not None:
        allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        allowed = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        allowed = "a finite number"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if not math.isfinite(value) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = allowed
    return parse


probability = finite_float(0.0, 1.0)  # an argparse ``type``: a number in [0, 1]


def read_text_file(path: str | Path, what: str = "text file") -> str:
    """The UTF-8 text of a file the user named, with errors that say which file and why: a
    missing one is :class:`InputNotFoundError` (exit status 1), one that is not UTF-8 a
    :class:`UsageError` (the file is the wrong kind of input)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputNotFoundError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a folder, not a file") from None
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{what} {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None


def check_files_exist(paths: Sequence[str], what: str) -> None:
    """Refuse a named input file that is not there before any model loads (the loader would
    notice only after the weights are read)."""
    for path in paths:
        if not Path(path).exists():
            raise InputNotFoundError(f"{what} {path} does not exist")


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
        raise UsageError(str(exc)) from None  # the message names --cache-bits


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--ids must be comma-separated integers, got '{text}'") from None


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
    dependency set): ``python -m engine.bench.kernels ARGS`` on a GPU host, for instance.
    Errors end as they do under ``python -m engine`` (one line, an exit status)."""
    from engine.cli import ArgumentParser, add_traceback_flag, run_command

    # Run as ``python -m``, the module is ``__main__``; its spec still knows the dotted name.
    spec = getattr(sys.modules.get(register.__module__), "__spec__", None)
    parser = ArgumentParser(prog=f"python -m {spec.name if spec else register.__module__}")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    add_traceback_flag(parser, sub)
    return run_command(parser, [command, *(sys.argv[1:] if argv is None else argv)])
