"""Where the app keeps its files: the platform's data directory, overridable for tests and
portable installs with ``TRELLIS_DATA_DIR`` (or ``--data-dir`` on the command line)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from pathlib import Path

from platformdirs import user_data_dir

APP_NAME = "trellis-chat"


def data_dir() -> Path:
    override = os.environ.get("TRELLIS_DATA_DIR")
    return Path(override) if override else Path(user_data_dir(APP_NAME, appauthor=False))


def database_path() -> Path:
    return data_dir() / "conversations.sqlite3"


def models_dir() -> Path:
    """The app's own models folder (the starter model and downloads land here). Honours
    ``TRELLIS_MODELS_DIR`` like ``engine.hub``'s download manager, so both agree."""
    override = os.environ.get("TRELLIS_MODELS_DIR")
    return Path(override).expanduser() if override else data_dir() / "models"


def fallback_dir() -> Path:
    """Where logs, crash reports and rescued messages go when their own folder cannot be written
    (a read-only or full data folder): the system's temporary folder, which nearly always can."""
    return Path(tempfile.gettempdir()) / f"{APP_NAME}-logs"


def is_writable_dir(path: Path) -> bool:
    """Whether ``path`` exists or can be created as a folder, and a file can be written in it. A
    real write, not ``os.access``: root passes every permission check yet still cannot write to a
    read-only mount, and no check sees a full disk."""
    probe = Path(path) / f".write-test-{uuid.uuid4().hex}"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"x")
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return True


def writable_dir(preferred: Path) -> Path:
    """``preferred`` if it can be written, else :func:`fallback_dir` (created if needed)."""
    if is_writable_dir(preferred):
        return Path(preferred)
    fallback = fallback_dir()
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback
