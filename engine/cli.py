"""``python -m engine``: the engine's command line.

Each subcommand lives in its own module under ``engine/commands/`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to the function that runs it.

Errors a user can act on end in one line on stderr, ``error: ...``, never a traceback:

- exit status 2: the command line is wrong (argparse's complaints, an option out of range) or the
  engine refused an input it was given (an :class:`~engine.errors.EngineError`: a corrupt file, a
  prompt longer than the context, a gated repository...);
- exit status 1: a file or folder the command needs does not exist or cannot be opened
  (:class:`~engine.errors.InputNotFoundError`, ``OSError``);
- 130: interrupted.

Anything else is a bug and keeps its traceback; ``--traceback`` (before or after the subcommand)
shows it for the errors above too.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from engine.errors import EngineError, InputNotFoundError, UsageError

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

TRACEBACK_HELP = "on an error, show the Python traceback as well (for bug reports)"


class CommandLineError(UsageError):
    """argparse's complaint about the command line (unknown option, missing or malformed value)."""


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are raised, not printed with the usage and exited on: the
    dispatcher reports them in one line like every other error. Subparsers are of the same class
    (``add_subparsers`` makes them of its parser's type)."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(f"{message} (see {self.prog} --help)")


def add_traceback_flag(parser: argparse.ArgumentParser, subparsers: argparse._SubParsersAction) -> None:
    """``--traceback`` on ``parser`` and on each of its subcommands (people add it at the end). A
    subcommand's default is SUPPRESS: its namespace must not overwrite a flag given before it."""
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    for sub in subparsers.choices.values():
        sub.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m engine", description="Trellis inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"engine.commands.{name}")
        module.register(sub)
    add_traceback_flag(parser, sub)
    return parser


def exit_status(exc: BaseException) -> int:
    """The exit status for an error the user can act on (see the module docstring)."""
    return 1 if isinstance(exc, InputNotFoundError | OSError) else 2


def describe(exc: BaseException) -> str:
    """One line for ``exc``: an OSError by its file and reason (its own str reads
    ``[Errno 2] No such file or directory: 'x'``), anything else by its message."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where else exc.strerror
    return str(exc)


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` and run the chosen command's ``func``; errors become an exit
    status and one line on stderr (see the module docstring)."""
    show_traceback = False
    try:
        args = parser.parse_args(argv)
        show_traceback = bool(getattr(args, "traceback", False))
        return int(args.func(args) or 0)
    except (EngineError, OSError) as exc:
        if show_traceback:
            raise
        print(f"error: {describe(exc)}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)
