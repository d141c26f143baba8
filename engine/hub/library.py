"""Where downloaded models live on disk, and how a complete one is told from a half-downloaded one.

Layout of the models folder (``default_models_dir()``, or ``TRELLIS_MODELS_DIR``)::

    models/
      owner__name/                     the repo's main branch
        config.json, *.safetensors ... verified files, moved in only after the last one verified
        .trellis-complete.json         completion marker: repo, revision, commit, files + hashes
      owner__name@4.0bpw/              another branch of the same repo (EXL3 bitrates)
        .trellis-partial/              present while a download is unfinished
          plan.json                    the pinned commit and file list with sizes/hashes/verified
          parts/<path>.part            bytes received so far (resumable)

A model directory is usable **only** when its completion marker exists: the marker is written
last, atomically, after every file was verified and moved in place. ``installed_models`` lists only
such directories, so nothing half-downloaded is ever offered to the user.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETE_MARKER = ".trellis-complete.json"
PARTIAL_DIR = ".trellis-partial"
PLAN_FILE = "plan.json"
PARTS_DIR = "parts"


def default_models_dir() -> Path:
    """``$TRELLIS_MODELS_DIR`` or the per-user data folder (e.g. ``~/.local/share/trellis-chat/models``)."""
    env = os.environ.get("TRELLIS_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("trellis-chat", appauthor=False)) / "models"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def model_dir_name(repo_id: str, revision: str | None = None) -> str:
    """Folder name for a repo at a revision: ``owner__name`` or ``owner__name@branch``.

    Always one plain, visible path component, whatever the id (it may come from a search answer
    of an untrusted mirror): ``..`` or ``.`` would be the parent or the models folder itself, and a
    leading dot would hide the model or collide with the folder's own ``.trellis-*`` files. Real
    Hub ids never start with a dot, so this changes no real name.
    """
    name = _UNSAFE.sub("_", repo_id.replace("/", "__"))
    name = re.sub(r"^\.+", lambda m: "_" * len(m.group(0)), name) or "_"
    if revision and revision != "main":
        name += "@" + _UNSAFE.sub("_", revision)
    return name


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON so that a reader (or a restart after a crash) sees the old or the new file, never half.

    Writes a temporary file in the same directory, fsyncs it, renames it over the target and
    fsyncs the directory so the rename itself survives a power cut.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open directories; the rename is durable enough there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: Path) -> Any | None:
    """The JSON in a file, or None if it is missing or unreadable (a torn write is treated as absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_complete(model_dir: Path) -> bool:
    """True when the directory holds a verified, complete download."""
    return read_marker(model_dir) is not None


def read_marker(model_dir: Path) -> dict | None:
    data = read_json(Path(model_dir) / COMPLETE_MARKER)
    return data if isinstance(data, dict) and data.get("complete") is True else None


@dataclass(frozen=True)
class InstalledModel:
    """A complete model directory."""

    path: Path
    repo_id: str
    revision: str
    commit: str | None
    size: int


def installed_models(models_dir: Path | None = None) -> list[InstalledModel]:
    """Complete model directories under ``models_dir`` (direct children), sorted by repo id."""
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    found: list[InstalledModel] = []
    if not root.is_dir():
        return found
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        marker = read_marker(child)
        if marker is None:
            continue
        found.append(
            InstalledModel(
                path=child,
                repo_id=str(marker.get("repo_id", child.name)),
                revision=str(marker.get("revision", "main")),
                commit=marker.get("commit"),
                size=sum(int(f.get("size", 0)) for f in marker.get("files", [])),
            )
        )
    return sorted(found, key=lambda m: (m.repo_id.lower(), m.revision))
