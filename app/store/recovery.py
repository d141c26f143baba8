"""Opening the conversation database at startup: health check, daily backup, and repair.

:func:`open_store` is the startup path (``app.__main__`` calls it instead of ``Store(...)``):

1. ``PRAGMA quick_check`` on the file, read-only (so a damaged file is not changed by the check
   itself: a read-only connection never checkpoints its WAL into the main file).
2. Healthy: open the store (migrating it, with a backup first) and take the day's backup.
3. Damaged (the check fails, or opening raises "file is not a database" / "malformed"):

   - the file and its ``-wal``/``-shm`` are *renamed* to ``<name>.corrupt-<time>`` (never
     deleted: it is the user's data, and the only copy of whatever the backup lacks);
   - the newest backup that passes its own ``quick_check`` is copied into place, or, with none,
     a fresh database is created;
   - :func:`salvage` reads every row it still can from a copy of the damaged file, table by table
     and row by row, and merges them in (ids kept: a row the backup has is updated to its newer
     version, a row it lacks is added), so the recent work the backup predates comes back too.

The outcome is a :class:`StartupReport` for the GUI to show; nothing here touches Qt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.store.backup import KEEP_DAILY, backups, daily_backup, quick_check
from app.store.database import OPEN_TIMEOUT_S
from app.store.errors import describe, is_corruption
from app.store.store import Store

log = logging.getLogger(__name__)

# Merge order: a row's parents before the row (conversations before their messages, images before
# the references to them; messages are read in id order, and a parent's id is always lower).
TABLES = ("conversations", "settings", "images", "messages", "message_images")
# Without a readable max(rowid), how far past the last readable row to keep probing.
_MAX_GAP = 10_000
_MAGIC = b"SQLite format 3\x00"
_SIDECARS = ("-wal", "-shm", "-journal")


class StoreOpenError(RuntimeError):
    """The database cannot be opened for a reason a repair would not fix (locked by another
    program, a read-only or full disk); the message says so in plain words."""


@dataclass
class TableSalvage:
    read: int = 0  # rows read from the damaged file
    added: int = 0  # ... that the restored database lacked
    updated: int = 0  # ... that it had in an older version
    unreadable: int = 0  # row ids that raised on reading
    missing: int = 0  # ... of those, the ones the restored database lacks too: lost (at most)
    rejected: int = 0  # read, but not valid rows (garbage from a damaged page)


@dataclass
class SalvageResult:
    tables: dict[str, TableSalvage] = field(default_factory=dict)
    error: str = ""  # why nothing could be read, when so

    def count(self, what: str) -> int:
        return sum(getattr(t, what) for t in self.tables.values())


@dataclass
class StartupReport:
    """What the startup check found and did; ``problem`` is empty when the database was healthy."""

    db_path: Path
    problem: str = ""
    moved_aside: list[Path] = field(default_factory=list)
    restored_from: Path | None = None
    started_fresh: bool = False
    salvage: SalvageResult = field(default_factory=SalvageResult)
    backup: Path | None = None  # the day's backup, when one was taken this start

    @property
    def recovered(self) -> bool:
        return bool(self.problem)

    @property
    def damaged_file(self) -> Path | None:
        return self.moved_aside[0] if self.moved_aside else None

    def message(self) -> str:
        """Plain text for a dialog (or stderr): what was wrong, where the damaged file is, what
        came back and what did not."""
        if not self.recovered:
            return ""
        lines = [f"The conversation database was damaged ({_shorten(self.problem)}) and has been repaired."]
        if self.damaged_file is not None:
            lines.append(f"The damaged file was kept, unchanged, as:\n{self.damaged_file}")
        if self.restored_from is not None:
            lines.append(f"Conversations were restored from the backup {self.restored_from.name}.")
        elif self.started_fresh:
            lines.append("There was no usable backup, so a new database was started.")
        tables = self.salvage.tables
        conv, msgs = tables.get("conversations", TableSalvage()), tables.get("messages", TableSalvage())
        if (conv.read or msgs.read) and self.restored_from is None:
            lines.append(
                f"Read back from the damaged file: {conv.added} conversation(s) and {msgs.added} message(s)."
            )
        elif conv.read or msgs.read:
            lines.append(
                f"Read back from the damaged file: {conv.read} conversation(s) and {msgs.read} "
                f"message(s); {conv.added} conversation(s) and {msgs.added} message(s) newer than "
                f"the backup were added, and {conv.updated + msgs.updated} changed since it were updated."
            )
        if self.salvage.error:
            lines.append(f"Nothing more could be read from the damaged file ({self.salvage.error}).")
        lost = self.salvage.count("missing") + self.salvage.count("rejected")
        if lost:
            elsewhere = " and were not in the backup either" if self.restored_from is not None else ""
            lines.append(
                f"Up to {lost} row(s) could not be read from the damaged file{elsewhere}; they are lost."
            )
        return "\n\n".join(lines)


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- the startup path ------------------------------------------------------------------------------


def open_store(
    path: str | Path, keep_daily: int = KEEP_DAILY, now: float | None = None
) -> tuple[Store, StartupReport]:
    """Open the app's database at ``path``, repairing it if it is damaged (see the module doc).
    Raises :class:`StoreOpenError` when it cannot be opened for another reason, and
    ``SchemaTooNewError`` (untouched) for a database from a newer app."""
    path = Path(path)
    report = StartupReport(path)
    problem = check_file(path)
    if problem == "ok":
        try:
            store = Store(path)
        except sqlite3.DatabaseError as exc:
            if not is_corruption(exc):
                raise StoreOpenError(
                    describe(exc, "open the conversation database", will_retry=False)
                ) from exc
            problem = str(exc)
        except OSError as exc:  # the data folder cannot be created
            raise StoreOpenError(
                f"Could not open the conversation database: {exc}. Make the folder writable, or "
                "start Trellis Chat with --data-dir pointing to a folder that is."
            ) from exc
        else:
            report.backup = daily_backup(store.db, path, keep_daily, now)
            return store, report
    report.problem = problem
    log.error("the conversation database %s is damaged: %s", path, problem)
    store = recover(path, report)
    return store, report


def check_file(path: Path) -> str:
    """Returns "ok" for a healthy (or absent, or empty) database file, else what is wrong with
    it. A problem that is not damage (locked, unreadable) raises :class:`StoreOpenError`."""
    try:
        if not path.exists() or path.stat().st_size == 0:
            return "ok"
    except OSError as exc:
        raise StoreOpenError(f"Could not open the conversation database: {exc}") from exc
    try:
        # Read-only: checking must not change the file (no WAL checkpoint into a damaged file).
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=OPEN_TIMEOUT_S)
    except sqlite3.Error as exc:
        if is_corruption(exc):
            return str(exc)
        raise StoreOpenError(describe(exc, "open the conversation database", will_retry=False)) from exc
    try:
        rows = [str(row[0]) for row in db.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as exc:
        if is_corruption(exc):
            return str(exc)
        raise StoreOpenError(describe(exc, "check the conversation database", will_retry=False)) from exc
    finally:
        db.close()
    return "ok" if rows == ["ok"] else "; ".join(rows[:5])


def recover(path: Path, report: StartupReport) -> Store:
    """Set the damaged database at ``path`` aside, restore the newest good backup (or start
    fresh), salvage what the damaged file still holds into it, and return the opened store."""
    report.moved_aside = move_aside(path)
    for candidate in backups(path):
        verdict = quick_check(candidate.path)
        if verdict == "ok":
            restore(candidate.path, path)
            report.restored_from = candidate.path
            break
        log.warning("backup %s is not usable either: %s", candidate.path, verdict)
    else:
        report.started_fresh = True
    try:
        store = Store(path)
    except sqlite3.Error as exc:
        raise StoreOpenError(
            describe(exc, "open the repaired conversation database", will_retry=False)
        ) from exc
    if report.damaged_file is not None:
        try:
            report.salvage = salvage(report.damaged_file, store.db)
        except Exception as exc:  # best effort: the restored database must open whatever happens here
            log.exception("salvaging %s failed", report.damaged_file)
            report.salvage.error = str(exc)
    log.warning("conversation database repaired: %s", report.message().replace("\n\n", " "))
    return store


def move_aside(path: Path) -> list[Path]:
    """Rename the database and its sidecar files to ``<name>.corrupt-<time>[-wal|-shm]`` (the
    sidecars keep SQLite's naming, so the set still opens together); returns the new paths, the
    main file first."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    moved = []
    for suffix in ("", *_SIDECARS):
        source = Path(str(path) + suffix)
        if not source.exists():
            continue
        target = Path(str(aside) + suffix)
        try:
            os.replace(source, target)
        except OSError as exc:
            raise StoreOpenError(
                f"The conversation database {path} is damaged, and it could not be moved aside to "
                f"repair it ({exc}). Nothing was changed; free space or fix the folder's permissions "
                "and start Trellis Chat again."
            ) from exc
        moved.append(target)
    return moved


def restore(backup: Path, path: Path) -> None:
    """Copy the backup into ``path`` with the backup API (a consistent copy, whatever the file)."""
    source = sqlite3.connect(f"{backup.resolve().as_uri()}?mode=ro", uri=True)
    try:
        dest = sqlite3.connect(str(path))
        try:
            source.backup(dest)
        finally:
            dest.close()
    finally:
        source.close()


# -- salvage -------------------------------------------------------------------------------------


def salvage(damaged: Path, target: sqlite3.Connection) -> SalvageResult:
    """Copy every row still readable in ``damaged`` into ``target`` (see :func:`read_rows`),
    keeping ids. Works on a copy in a temporary folder, so the damaged file is never written; if
    there is no room for a copy, reads the file in place, read-only."""
    with tempfile.TemporaryDirectory(prefix="trellis-salvage-") as tmp:
        work = Path(tmp) / "damaged.sqlite3"
        try:
            shutil.copyfile(damaged, work)
            wal = Path(str(damaged) + "-wal")
            if wal.exists():
                shutil.copyfile(wal, Path(str(work) + "-wal"))
            source = _open_repaired(work)
        except OSError as exc:
            log.warning("no room to copy %s for salvage (%s); reading it in place", damaged, exc)
            source = _open_readonly(damaged)
        if source is None:
            return SalvageResult(error="its table list cannot be read")
        try:
            return _salvage_into(source, target)
        finally:
            source.close()


def _open_readonly(path: Path) -> sqlite3.Connection | None:
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    if not _schema_readable(db):
        db.close()
        return None
    return _tolerant(db)


def _tolerant(db: sqlite3.Connection) -> sqlite3.Connection:
    # A damaged page can hold bytes that are not UTF-8: keep the readable part of such text.
    db.text_factory = lambda raw: raw.decode("utf-8", "replace")
    return db


def _schema_readable(db: sqlite3.Connection) -> bool:
    try:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError:
        return False
    return bool(names & set(TABLES))


def _open_repaired(work: Path) -> sqlite3.Connection | None:
    """Open the copy ``work``; if its header is unreadable, rewrite the header and try again."""
    db = _try_open(work)
    if db is not None:
        return db
    for header in _candidate_headers(work):
        with open(work, "r+b") as f:
            f.write(header)
        db = _try_open(work)
        if db is not None:
            log.info("salvage: rebuilt the damaged file's header (page size %d)", _page_size(header))
            return db
    return None


def _try_open(work: Path) -> sqlite3.Connection | None:
    try:
        db = sqlite3.connect(str(work), isolation_level=None)
    except sqlite3.Error:
        return None
    if _schema_readable(db):
        return _tolerant(db)
    db.close()
    return None


def _page_size(header: bytes) -> int:
    raw = struct.unpack(">H", header[16:18])[0]
    return 65536 if raw == 1 else raw


def _candidate_headers(work: Path) -> list[bytes]:
    """Plausible 100-byte headers for a file whose own is damaged. The header is mostly derivable:
    the magic string, the page size (tried in the order SQLite picks them; the file size must be a
    multiple), the format numbers, and the page count taken from the file size. What cannot be
    known (the free-page list, the user version) is left empty: salvage reads tables by their root
    pages in the schema, which starts on page 1 right after the header, and needs neither."""
    size = work.stat().st_size
    with_wal = Path(str(work) + "-wal").exists()
    headers = []
    for page_size in (4096, 1024, 2048, 8192, 16384, 32768, 65536, 512):
        if size < page_size or size % page_size:
            continue
        version = 2 if with_wal else 1  # 2 = WAL: its frames hold the newest pages
        header = bytearray(100)
        header[0:16] = _MAGIC
        header[16:18] = struct.pack(">H", 1 if page_size == 65536 else page_size)
        header[18], header[19] = version, version
        header[21], header[22], header[23] = 64, 32, 32  # payload fractions (fixed by the format)
        struct.pack_into(">I", header, 24, 1)  # change counter
        struct.pack_into(">I", header, 28, size // page_size)  # pages in the file
        struct.pack_into(">I", header, 44, 4)  # schema format 4
        struct.pack_into(">I", header, 56, 1)  # UTF-8
        struct.pack_into(">I", header, 92, 1)  # "page count valid for" = change counter
        struct.pack_into(">I", header, 96, sqlite3.sqlite_version_info[0] * 1_000_000)
        headers.append(bytes(header))
    return headers


def read_rows(source: sqlite3.Connection, table: str, columns: list[str]) -> tuple[list[tuple], list[int]]:
    """Every row of ``table`` that can be read, in rowid order, and the row ids that could not be
    (ids in a damaged stretch that never held a row are among them: the b-tree cannot tell).

    A scan stops at the first damaged page with "database disk image is malformed". Then the row
    ids after the last good one are looked up one by one (each lookup walks only its own path down
    the b-tree, so it fails only when that path is damaged) until one reads again, and the scan
    resumes from there. Row ids below 1 are not visited: the app's rows never have them.
    """
    names = ", ".join(_quote(c) for c in columns)
    select = f"SELECT rowid, {names} FROM {_quote(table)}"
    try:
        top = source.execute(f"SELECT max(rowid) FROM {_quote(table)}").fetchone()[0]
    except sqlite3.DatabaseError:
        top = None
    rows: list[tuple] = []
    unreadable: list[int] = []
    last = 0
    while True:
        try:
            for row in source.execute(f"{select} WHERE rowid > ? ORDER BY rowid", (last,)):
                rows.append(tuple(row[1:]))
                last = row[0]
            return rows, unreadable
        except sqlite3.DatabaseError:
            pass
        limit = top if isinstance(top, int) and top > last else last + _MAX_GAP
        found = None
        for probe in range(last + 1, limit + 1):
            try:
                found = source.execute(f"{select} WHERE rowid = ?", (probe,)).fetchone()
            except sqlite3.DatabaseError:
                unreadable.append(probe)
                continue
            if found is not None:
                break
        if found is None:
            return rows, unreadable
        rows.append(tuple(found[1:]))
        last = found[0]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _columns(db: sqlite3.Connection, table: str) -> tuple[list[str], list[str]]:
    """A table's columns, and its primary key columns in key order."""
    info = list(db.execute(f"PRAGMA table_info({_quote(table)})"))
    columns = [row[1] for row in info]
    key = [row[1] for row in sorted((r for r in info if r[5]), key=lambda r: r[5])]
    return columns, key


def _salvage_into(source: sqlite3.Connection, target: sqlite3.Connection) -> SalvageResult:
    result = SalvageResult()
    try:
        present = {row[0] for row in source.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        return SalvageResult(error=str(exc))
    batches = []
    for table in TABLES:
        if table not in present:
            continue
        try:
            source_columns, _ = _columns(source, table)
        except sqlite3.DatabaseError as exc:
            log.warning("salvage: the columns of %s cannot be read: %s", table, exc)
            continue
        target_columns, key = _columns(target, table)
        # An older file (restored or damaged) may lack newer columns: those take their defaults.
        columns = [c for c in source_columns if c in target_columns]
        if not key or any(k not in columns for k in key):
            continue
        rows, unreadable = read_rows(source, table, columns)
        result.tables[table] = TableSalvage(read=len(rows), unreadable=len(unreadable))
        batches.append((table, columns, key, rows, unreadable))
    # Parents may be among the unreadable rows, so references are checked after the merge, not
    # row by row during it (which would also refuse a message whose conversation comes later).
    target.execute("PRAGMA foreign_keys = OFF")
    try:
        target.execute("BEGIN IMMEDIATE")
        try:
            for table, columns, key, rows, _ in batches:
                _merge(target, table, columns, key, rows, result.tables[table])
            _repair_references(target)
            for table, _, key, _, unreadable in batches:
                result.tables[table].missing = _missing(target, table, key, unreadable)
            target.execute("COMMIT")
        except BaseException:
            target.execute("ROLLBACK")
            raise
    finally:
        target.execute("PRAGMA foreign_keys = ON")
    broken = target.execute("PRAGMA foreign_key_check").fetchall()
    if broken:
        log.warning("salvage left %d broken references", len(broken))
    return result


def _merge(
    db: sqlite3.Connection,
    table: str,
    columns: list[str],
    key: list[str],
    rows: list[tuple],
    stats: TableSalvage,
) -> None:
    key_at = [columns.index(k) for k in key]
    names = ", ".join(_quote(c) for c in columns)
    where = " AND ".join(f"{_quote(k)} = ?" for k in key)
    select = f"SELECT {names} FROM {_quote(table)} WHERE {where}"
    insert = f"INSERT INTO {_quote(table)} ({names}) VALUES ({', '.join('?' for _ in columns)})"
    update = f"UPDATE {_quote(table)} SET {', '.join(f'{_quote(c)} = ?' for c in columns)} WHERE {where}"
    for row in rows:
        key_values = tuple(row[i] for i in key_at)
        if any(v is None for v in key_values):
            stats.rejected += 1
            continue
        try:
            existing = db.execute(select, key_values).fetchone()
            if existing is None:
                db.execute(insert, row)
                stats.added += 1
            elif tuple(existing) != row:
                # The damaged file is the newer of the two: its version of the row wins.
                db.execute(update, (*row, *key_values))
                stats.updated += 1
        except sqlite3.IntegrityError:
            stats.rejected += 1  # garbage that happened to parse (a CHECK or NOT NULL refuses it)


def _missing(db: sqlite3.Connection, table: str, key: list[str], rowids: list[int]) -> int:
    """How many of the unreadable ``rowids`` the merged database lacks. Only an INTEGER PRIMARY KEY
    is the rowid; for other keys the ids say nothing about which rows they were, so all count."""
    if not rowids:
        return 0
    info = {row[1]: row[2] for row in db.execute(f"PRAGMA table_info({_quote(table)})")}
    if len(key) != 1 or info.get(key[0], "").upper() != "INTEGER":
        return len(rowids)
    present = db.execute(
        f"SELECT count(*) FROM {_quote(table)} WHERE rowid IN (SELECT value FROM json_each(?))",
        (json.dumps(rowids),),
    ).fetchone()[0]
    return len(rowids) - int(present)


def _repair_references(db: sqlite3.Connection) -> None:
    """Make the merged rows consistent where some of their parents could not be read."""
    # Messages whose conversation row was lost get a conversation again (same id), so they show.
    orphans = db.execute(
        "SELECT conversation_id, min(created_at), max(created_at), max(id) FROM messages"
        " WHERE conversation_id NOT IN (SELECT id FROM conversations) GROUP BY conversation_id"
    ).fetchall()
    for conversation_id, first, last, leaf in orphans:
        db.execute(
            "INSERT INTO conversations (id, title, created_at, updated_at, current_leaf_id)"
            " VALUES (?, ?, ?, ?, ?)",
            (conversation_id, f"Recovered chat {conversation_id}", first, last, leaf),
        )
    # A message whose parent is lost becomes a root: its text stays reachable, as a branch.
    db.execute(
        "UPDATE messages SET parent_id = NULL WHERE parent_id IS NOT NULL"
        " AND parent_id NOT IN (SELECT id FROM messages)"
    )
    db.execute(
        "DELETE FROM message_images WHERE message_id NOT IN (SELECT id FROM messages)"
        " OR sha256 NOT IN (SELECT sha256 FROM images)"
    )
    db.execute(
        "UPDATE conversations SET current_leaf_id ="
        " (SELECT max(id) FROM messages m WHERE m.conversation_id = conversations.id)"
        " WHERE current_leaf_id IS NOT NULL AND current_leaf_id NOT IN"
        " (SELECT id FROM messages m WHERE m.conversation_id = conversations.id)"
    )
