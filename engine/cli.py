"""``python -m engine``: the engine's command line.

Each subcommand lives in its own module and exposes ``register(subparsers)``, which adds its
parser and sets ``func`` to the function that runs it. The user-facing commands are under
``engine/commands/`` (:data:`COMMAND_MODULES`); the measurement tools (benchmarks, profilers,
acceptance runs) are under ``engine/bench/`` and listed by name in ``engine.bench.VERBS``: their
modules import torch and more at import time, so each is imported only when its verb runs.

Errors a user can act on end in one line on stderr, ``error: ...``, never a traceback:

- exit status 2: the command line is wrong (argparse's complaints, an option out of range) or the
  engine refused an input it was given (an :class:`~engine.errors.EngineError`: a corrupt file, a
  prompt longer than the context, a gated repository...);
- exit status 1: a file or folder the command needs does not exist or cannot be opened
  (:class:`~engine.errors.InputNotFoundError`, ``OSError``);
- 130: interrupted.

Anything else is a bug and keeps its traceback; ``--traceback`` (before or after the subcommand)
shows it for the errors above too.

Every command gets ``args.options``: the :class:`~engine.options.EngineOptions` of the run, from
the development switches of the environment (:meth:`EngineOptions.from_environment`); commands
put their own flags on top and pass them on.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from engine.errors import EngineError, InputNotFoundError, UsageError
from engine.options import EngineOptions

# Modules under engine.commands, one per subcommand family. Order is the order in --help, before
# the measurement tools of engine.bench.
COMMAND_MODULES = [
    "generate",
    "logits",
    "ppl",
    "cache_capacity",
    "import_gguf",
    "download",
    "search",
    "convert",
    "build_ext",
    "serve",
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


def add_subcommand_traceback_flag(sub: argparse.ArgumentParser) -> None:
    """``--traceback`` on one subcommand (people add it at the end). Its default is SUPPRESS: the
    subcommand's namespace must not overwrite a flag given before it."""
    sub.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)


def add_traceback_flag(parser: argparse.ArgumentParser, subparsers: argparse._SubParsersAction) -> None:
    """``--traceback`` on ``parser`` and on each of its subcommands."""
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    for sub in subparsers.choices.values():
        add_subcommand_traceback_flag(sub)


class LazySubcommands(argparse._SubParsersAction):
    """Subparsers some of which are only a name and a help line until chosen: then their module is
    imported and its ``register`` adds the real parser in the placeholder's stead. ``--help`` and
    every other subcommand never import those modules."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lazy: dict[str, str] = {}

    def add_lazy(self, name: str, module: str, help: str) -> None:
        self.add_parser(name, help=help, add_help=False)
        self._lazy[name] = module

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        module = self._lazy.pop(values[0], None) if values else None
        if module is not None:
            self._load(values[0], module)
        super().__call__(parser, namespace, values, option_string)

    def _load(self, name: str, module: str) -> None:
        # Drop the placeholder (parser and help entry): add_parser refuses a name twice.
        del self._name_parser_map[name]
        self._choices_actions = [a for a in self._choices_actions if a.dest != name]
        importlib.import_module(module).register(self)
        add_subcommand_traceback_flag(self._name_parser_map[name])


def build_parser() -> argparse.ArgumentParser:
    from engine.bench import VERBS  # a table of names: imports nothing of the tools themselves

    parser = ArgumentParser(prog="python -m engine", description="Trellis inference engine")
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubcommands)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"engine.commands.{name}")
        module.register(sub)
    for verb in VERBS:
        sub.add_lazy(verb.name, verb.module, verb.help)
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
        args.options = EngineOptions.from_environment()
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
