"""Rolling backups of the conversation database, made with SQLite's online backup API.

Two kinds live in ``<data dir>/backups/``:

- ``<stem>-daily-<YYYYmmdd-HHMMSS>.sqlite3``: at most one per calendar day, taken at startup once
  the database has passed its health check (a backup of a damaged file would be worthless). The
  newest ``KEEP_DAILY`` are kept.
- ``<stem>-pre-v<N>-<YYYYmmdd-HHMMSS>.sqlite3``: taken just before a schema migration from version
  N, so a migration that goes wrong never costs the conversations. The newest ``KEEP_MIGRATION``
  are kept.

``Connection.backup`` copies a consistent snapshot (the WAL's committed content included) while
the app keeps its connection open, unlike a file copy, which could catch a half-checkpointed file.
A backup is written to a temporary name, made a self-contained rollback-journal file, checked with
``quick_check`` and only then renamed into place, so a file with a backup's name is always a
complete, healthy database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BACKUP_DIR = "backups"
KEEP_DAILY = 3
KEEP_MIGRATION = 3
_STAMP = "%Y%m%d-%H%M%S"
_NAME = re.compile(r"^(?P<stem>.+)-(?P<kind>daily|pre-v\d+)-(?P<stamp>\d{8}-\d{6})(?:-(?P<n>\d+))?\.sqlite3$")


@dataclass(frozen=True)
class Backup:
    path: Path
    kind: str  # "daily" or "pre-v<N>"
    taken_at: float  # from the name, so copying the folder around keeps the order

    @property
    def day(self) -> str:
        return time.strftime("%Y%m%d", time.localtime(self.taken_at))


def backup_dir(db_path: Path) -> Path:
    return Path(db_path).parent / BACKUP_DIR


def backups(db_path: Path, kind: str | None = None) -> list[Backup]:
    """The backups of ``db_path`` (of one ``kind``, or all), newest first."""
    folder = backup_dir(db_path)
    stem = Path(db_path).stem
    found: list[tuple[float, int, Backup]] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    for path in entries:
        match = _NAME.match(path.name)
        if match is None or match["stem"] != stem or (kind is not None and match["kind"] != kind):
            continue
        try:
            taken = time.mktime(time.strptime(match["stamp"], _STAMP))
        except ValueError:
            continue
        found.append((taken, int(match["n"] or 0), Backup(path, match["kind"], taken)))
    found.sort(key=lambda entry: (entry[0], entry[1]), reverse=True)
    return [entry[2] for entry in found]


def quick_check(path: Path) -> str:
    """``PRAGMA quick_check`` of the file at ``path`` without changing it: "ok", or what is wrong."""
    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error as exc:
        return f"cannot be opened: {exc}"
    try:
        rows = [row[0] for row in db.execute("PRAGMA quick_check")]
    except sqlite3.Error as exc:
        return str(exc)
    finally:
        db.close()
    return "ok" if rows == ["ok"] else "; ".join(str(r) for r in rows[:5])


def make_backup(source: sqlite3.Connection, target: Path) -> Path:
    """Copy the database behind ``source`` into ``target`` (atomically: a temporary file renamed
    into place once complete and checked). Raises ``sqlite3.Error``/``OSError`` on failure, leaving
    no partial file behind."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    for leftover in _with_sidecars(partial):
        leftover.unlink(missing_ok=True)
    try:
        dest = sqlite3.connect(str(partial), isolation_level=None)
        try:
            source.backup(dest)
            # The copy keeps the source's WAL flag; a backup must be one file that can be copied
            # or opened read-only on its own.
            dest.execute("PRAGMA journal_mode = DELETE")
        finally:
            dest.close()
        problem = quick_check(partial)
        if problem != "ok":
            raise sqlite3.DatabaseError(f"the backup failed its check: {problem}")
        os.replace(partial, target)
    finally:
        for leftover in _with_sidecars(partial):
            leftover.unlink(missing_ok=True)
    return target


def _with_sidecars(path: Path) -> list[Path]:
    return [Path(str(path) + suffix) for suffix in ("", "-journal", "-wal", "-shm")]


def _target(db_path: Path, kind: str, now: float) -> Path:
    folder = backup_dir(db_path)
    name = f"{Path(db_path).stem}-{kind}-{time.strftime(_STAMP, time.localtime(now))}"
    path = folder / f"{name}.sqlite3"
    n = 1
    while path.exists():  # two in one second (tests, or migrations run back to back)
        n += 1
        path = folder / f"{name}-{n}.sqlite3"
    return path


def rotate(db_path: Path, kind: str, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest backups of ``kind``; returns what was deleted. Only our
    own backup files are ever deleted here (never the database or a file set aside as damaged)."""
    removed = []
    for old in backups(db_path, kind)[keep:]:
        try:
            old.path.unlink()
            removed.append(old.path)
        except OSError as exc:
            log.warning("could not delete old backup %s: %s", old.path, exc)
    return removed


def daily_backup(
    db: sqlite3.Connection, db_path: Path, keep: int = KEEP_DAILY, now: float | None = None
) -> Path | None:
    """Today's backup, unless one was already taken today; returns its path (None: not needed or
    not possible; a failed backup is logged, never raised: it must not stop the app starting)."""
    now = time.time() if now is None else now
    today = time.strftime("%Y%m%d", time.localtime(now))
    if any(b.day == today for b in backups(db_path, "daily")):
        return None
    try:
        path = make_backup(db, _target(db_path, "daily", now))
    except (sqlite3.Error, OSError) as exc:
        log.warning("could not back up %s: %s", db_path, exc)
        return None
    rotate(db_path, "daily", keep)
    log.info("backed up the conversations to %s", path)
    return path


def migration_backup(
    db: sqlite3.Connection, db_path: Path, from_version: int, keep: int = KEEP_MIGRATION
) -> Path:
    """A backup before migrating from ``from_version``. Raises if it cannot be made: a migration
    without its safety copy should not run (the app can still refuse to start with a message)."""
    path = make_backup(db, _target(db_path, f"pre-v{from_version}", time.time()))
    # Rotated together, whatever version each was taken before: the newest few are what matter.
    for old in [b for b in backups(db_path) if b.kind.startswith("pre-v")][keep:]:
        with contextlib.suppress(OSError):
            old.path.unlink()
    log.info("backed up the conversations before migrating from v%d: %s", from_version, path)
    return path
