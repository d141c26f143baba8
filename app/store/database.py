"""Opening the SQLite file: pragmas chosen for a desktop app that may be killed at any moment."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from app.store.migrations import migrate


def connect(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) and migrate the database at ``path``.

    - ``isolation_level=None``: autocommit; every write helper in the store is its own short
      transaction (or an explicit BEGIN/COMMIT), so nothing sits uncommitted waiting for a later
      commit that a crash would never run.
    - WAL: readers never block the writer and a kill mid-write can't corrupt the main file; the
      WAL is replayed (or its torn tail discarded) on the next open.
    - ``synchronous=NORMAL``: in WAL mode this is durable against a process crash or kill -9
      (the OS has the data) and only risks the last transactions on power loss, never corruption;
      FULL would fsync on every commit and could stall the GUI thread on slow disks.
    """
    path = Path(path)
    if str(path) != ":memory:":
        path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), isolation_level=None, timeout=5.0)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute("PRAGMA foreign_keys = ON")
    migrate(db)
    return db


def integrity_ok(db: sqlite3.Connection) -> bool:
    """``PRAGMA integrity_check`` says 'ok'."""
    return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
