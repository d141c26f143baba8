"""Opening the SQLite file: pragmas chosen for a desktop app that may be killed at any moment."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from app.store.backup import migration_backup
from app.store.migrations import LATEST_VERSION, migrate, schema_version

# How long the app's (GUI-thread) connection waits for another connection's write lock before a
# write fails with "database is locked". Short on purpose: the caller retries later from a timer
# instead of freezing the window (see app.chat.controller).
GUI_BUSY_TIMEOUT_MS = 50
# Opening may have to migrate, which needs the write lock; that happens before any window exists,
# so waiting a few seconds for another process to finish is better than failing outright.
OPEN_TIMEOUT_S = 5.0


def connect(path: str | Path, busy_timeout_ms: int = GUI_BUSY_TIMEOUT_MS) -> sqlite3.Connection:
    """Open (creating if needed) and migrate the database at ``path``.

    - ``isolation_level=None``: autocommit; every write helper in the store is its own short
      transaction (or an explicit BEGIN/COMMIT), so nothing sits uncommitted waiting for a later
      commit that a crash would never run.
    - WAL: readers never block the writer and a kill mid-write can't corrupt the main file; the
      WAL is replayed (or its torn tail discarded) on the next open.
    - ``synchronous=NORMAL``: in WAL mode this is durable against a process crash or kill -9
      (the OS has the data) and only risks the last transactions on power loss, never corruption;
      FULL would fsync on every commit and could stall the GUI thread on slow disks.
    - Before a schema migration of an existing database, a backup (``app.store.backup``).
    - Once open, the busy timeout drops to ``busy_timeout_ms``: see ``GUI_BUSY_TIMEOUT_MS``.
    """
    path = Path(path)
    on_disk = str(path) != ":memory:"
    if on_disk:
        path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), isolation_level=None, timeout=OPEN_TIMEOUT_S)
    try:
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
        version = schema_version(db)
        if on_disk and 0 < version < LATEST_VERSION:
            migration_backup(db, path, version)
        migrate(db)
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    except BaseException:
        db.close()
        raise
    return db


def integrity_ok(db: sqlite3.Connection) -> bool:
    """``PRAGMA integrity_check`` says 'ok'."""
    return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def quick_check(db: sqlite3.Connection) -> str:
    """``PRAGMA quick_check``: "ok", or the first problems it names. Much faster than
    ``integrity_check`` (no index-against-table cross checks) yet it reads every page, so it finds
    the damaged pages that would otherwise surface one failed send at a time."""
    rows = [str(row[0]) for row in db.execute("PRAGMA quick_check")]
    return "ok" if rows == ["ok"] else "; ".join(rows[:5])
