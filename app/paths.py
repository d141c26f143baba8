"""Where the app keeps its files: the platform's data directory, overridable for tests and
portable installs with ``TRELLIS_DATA_DIR`` (or ``--data-dir`` on the command line)."""

from __future__ import annotations

import os
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
