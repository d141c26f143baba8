"""Startup hook: import torch from the installed GPU runtime instead of the bundled CPU build.

Runs in ``app.__main__.main`` before anything imports torch. ``<data dir>/runtime/current`` names
the runtime in use; the installer writes it last, after the runtime was unpacked and a child
process started with it and found the GPU, so a half-finished install is never named there. Here
the runtime is checked once more, cheaply (its record, this Python's ABI, torch's files), and
its ``site-packages`` goes first on ``sys.path``. Anything wrong: the bundled CPU torch is used
and the reason is printed and kept for the GUI; the app always starts.

Light on purpose: no torch, no Qt, no network.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.runtime.variant import python_tag

CURRENT = "current"
RECORD = "runtime.json"
SITE = "site-packages"
# Set by the installer for its check child: use this runtime folder instead of ``current``.
CANDIDATE_ENV = "TRELLIS_RUNTIME_CANDIDATE"
# TRELLIS_RUNTIME=cpu starts with the bundled CPU torch even when a runtime is installed.
SWITCH_ENV = "TRELLIS_RUNTIME"
# Source installs manage their own torch; the hook runs in the frozen bundle, or where this is 1.
ENABLE_ENV = "TRELLIS_MANAGED_RUNTIME"


@dataclass(frozen=True)
class Activation:
    runtime: Path | None  # the runtime folder whose site-packages is on sys.path; None: CPU torch
    message: str | None = None  # why the installed runtime is not used (None: nothing to say)


_last: Activation | None = None


def managed_runtime_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this installation uses the managed runtime: the bundle does, source installs do
    not (their users install the CUDA build of torch with pip)."""
    env = os.environ if environ is None else environ
    return bool(getattr(sys, "frozen", False)) or env.get(ENABLE_ENV) == "1"


def runtime_root(data_dir: Path) -> Path:
    return Path(data_dir) / "runtime"


def data_dir_from_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Path:
    """The data folder the app is about to use: ``--data-dir`` on the command line wins, as in
    ``app.__main__`` (which parses its arguments only after this hook ran)."""
    for i, arg in enumerate(argv):
        if arg == "--data-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--data-dir="):
            return Path(arg.split("=", 1)[1])
    env = os.environ if environ is None else environ
    if env.get("TRELLIS_DATA_DIR"):
        return Path(env["TRELLIS_DATA_DIR"])
    from app.paths import data_dir

    return data_dir()


def read_current(root: Path) -> str | None:
    try:
        name = (Path(root) / CURRENT).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name or None


def problem_with(folder: Path) -> str | None:
    """Why the runtime in ``folder`` cannot be used here, or None when it can."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return f"{folder} has no readable {RECORD} (an incomplete or damaged install)"
    if not isinstance(record, dict) or record.get("complete") is not True:
        return f"{folder} is not a completed install"
    if record.get("python") != python_tag():
        return f"it was made for Python {record.get('python')}, this app runs {python_tag()}"
    if not (folder / SITE / "torch" / "__init__.py").is_file():
        return f"torch is missing from {folder / SITE}"
    return None


def activate(
    argv: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    modules: Mapping[str, object] | None = None,
) -> Activation:
    """Put the installed runtime first on ``sys.path``; return what was done and why.
    ``modules`` (default ``sys.modules``) tells whether torch was imported already."""
    global _last
    env = os.environ if environ is None else environ
    _last = result = _decide(argv, env, sys.modules if modules is None else modules)
    if result.runtime is not None:
        site = str(result.runtime / SITE)
        if site not in sys.path:
            sys.path.insert(0, site)
    elif result.message:
        print(f"Trellis Chat: {result.message}", file=sys.stderr)
    return result


def _decide(argv: Sequence[str], env: Mapping[str, str], modules: Mapping[str, object]) -> Activation:
    if env.get(SWITCH_ENV) == "cpu":
        return Activation(None, None)
    candidate = env.get(CANDIDATE_ENV)
    if candidate:
        folder = Path(candidate)
    else:
        root = runtime_root(data_dir_from_argv(argv, env))
        name = read_current(root)
        if name is None:
            return Activation(None, None)  # no runtime installed: the usual CPU bundle
        if "/" in name or "\\" in name or name in (".", ".."):
            return Activation(None, f"{root / CURRENT} names {name!r}, not a runtime folder; using the CPU")
        folder = root / name
    fallback = "using the bundled CPU build of torch"
    if "torch" in modules:
        return Activation(None, f"torch was imported before the GPU runtime could be set up; {fallback}")
    problem = problem_with(folder)
    if problem is not None:
        return Activation(None, f"the GPU runtime cannot be used ({problem}); {fallback}")
    return Activation(folder, None)


def last_activation() -> Activation | None:
    """What :func:`activate` did in this process (None: it did not run, e.g. a source install)."""
    return _last
