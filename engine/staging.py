"""Hidden staging folders that an import writes into before renaming the result into place.

``import_gguf`` builds a model in ``<parent>/.<name>.importing-<pid>-<random>`` and renames it to
``<parent>/<name>`` when done; an exception removes the folder. A process that is killed (kill -9,
a crash, a power cut, the app closed mid-import) cannot, and leaves the folder behind: for the
starter model that is ~450 MB nobody sees. ``remove_stale_staging`` reclaims such folders at
startup; ``is_staging_dir`` lets the library skip them.

When a folder is stale (``staleness``):

* The owner's PID is in the folder's name, set atomically when the folder is created (a file
  written inside afterwards would leave a moment where a concurrent cleanup sees no owner). If no
  process with that PID is alive, nobody can finish the import: stale.
* A live PID is not proof of ownership: after a reboot or PID wrap-around an unrelated process may
  have it, and the folder would then be kept forever. So a folder with a live owner is stale only
  when nothing in it was written for ``OWNED_IDLE_LIMIT`` (24 h). An import writes its weights
  continuously; the longest (a big GGUF to float32) takes well under an hour, so a day without a
  write is a hung or foreign process, never a working import.
* Folders made before the PID was recorded (``.<name>.importing-<random>``) have no owner to ask.
  They are stale after ``UNOWNED_IDLE_LIMIT`` (10 min) without a write: such a folder can only be
  live if an older build of the app is importing at this very moment, and that one writes all the
  time.

Only this module's own name pattern is ever deleted, and only folders (never a file or a link).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = [
    "OWNED_IDLE_LIMIT",
    "UNOWNED_IDLE_LIMIT",
    "is_staging_dir",
    "make_staging_dir",
    "pid_alive",
    "remove_stale_staging",
    "staleness",
]

OWNED_IDLE_LIMIT = 24 * 3600.0
UNOWNED_IDLE_LIMIT = 10 * 60.0

_MARK = ".importing-"
# mkdtemp's random part uses [a-z0-9_] only, so "<digits>-" after the mark can only be our PID.
_NAME = re.compile(r"^\.(?P<target>.+)\.importing-(?:(?P<pid>[0-9]+)-)?[A-Za-z0-9_]+$")


def make_staging_dir(out_dir: Path) -> Path:
    """A new, empty staging folder next to ``out_dir``, named with this process's PID."""
    out_dir = Path(out_dir)
    prefix = f".{out_dir.name}{_MARK}{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent))


def is_staging_dir(path: Path) -> bool:
    """True for a folder named like an import's staging folder (live or left behind)."""
    return _NAME.match(Path(path).name) is not None


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists now (any owner)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    if sys.platform == "win32":
        return _pid_alive_windows(pid)
    try:
        os.kill(pid, 0)  # signal 0: only the existence and permission checks
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to another user
    except OSError:
        return True  # unknown: keeping a folder is the safe mistake
    return True


def _pid_alive_windows(pid: int) -> bool:
    # os.kill(pid, 0) on Windows sends CTRL_C_EVENT (0) instead of probing: ask the kernel.
    import ctypes
    from ctypes import wintypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    kernel32.OpenProcess.restype = wintypes.HANDLE
    process_query_limited_information = 0x1000
    still_active = 259
    error_access_denied = 5
    handle = kernel32.OpenProcess(process_query_limited_information, False, pid)
    if not handle:
        return ctypes.get_last_error() == error_access_denied
    try:
        code = wintypes.DWORD()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == still_active
    finally:
        kernel32.CloseHandle(handle)


def _last_write(path: Path) -> float:
    """Newest mtime of the folder and what is directly in it (the files an import is writing)."""
    newest = path.stat().st_mtime
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    pass
    except OSError:
        pass
    return newest


def staleness(path: Path, now: float | None = None) -> str | None:
    """Why the staging folder ``path`` is abandoned, or None while it may still be in use."""
    m = _NAME.match(Path(path).name)
    if m is None:
        return None
    idle = (time.time() if now is None else now) - _last_write(Path(path))
    if m.group("pid") is None:
        if idle > UNOWNED_IDLE_LIMIT:
            return f"no owner recorded and nothing written for {idle / 60:.0f} min"
        return None
    pid = int(m.group("pid"))
    if not pid_alive(pid):
        return f"its importing process {pid} is gone"
    if idle > OWNED_IDLE_LIMIT:
        return f"nothing written for {idle / 3600:.0f} h (PID {pid} is alive but cannot be the owner)"
    return None


def remove_stale_staging(parent: Path, target: str | None = None) -> list[Path]:
    """Delete abandoned staging folders directly in ``parent`` (only those for ``target`` if given).

    Returns what was removed. Never raises for an unreadable folder: a cleanup must not stop the
    app from starting.
    """
    removed: list[Path] = []
    try:
        children = list(Path(parent).iterdir())
    except OSError:
        return removed
    for child in children:
        m = _NAME.match(child.name)
        if m is None or (target is not None and m.group("target") != target):
            continue
        try:
            if child.is_symlink() or not child.is_dir():
                continue
            why = staleness(child)
        except OSError:
            continue
        if why is None:
            continue
        log.info("removing abandoned import folder %s (%s)", child, why)
        shutil.rmtree(child, ignore_errors=True)
        if not child.exists():
            removed.append(child)
    return removed
