"""A damaged conversation database at startup: real bytes overwritten in a real file, then the
startup path (``open_store``) must not crash, must keep the damaged file aside unchanged, and must
bring the conversations back from the newest good backup plus whatever the damaged file still
holds. Also: daily backups rotate, and a migration is preceded by a backup."""

from __future__ import annotations

import hashlib
import random
import sqlite3
import time
from pathlib import Path

import pytest

from app.store import Store
from app.store.backup import backups, quick_check
from app.store.database import integrity_ok
from app.store.migrations import LATEST_VERSION, migrate
from app.store.recovery import open_store

DAY = 86400.0
PAGE = 4096  # SQLite's default page size, which the app's databases use


def _fill(store: Store, prefix: str, count: int) -> dict[int, list[str]]:
    """``count`` conversations of a question and a long-ish reply each; returns their texts."""
    made = {}
    for i in range(count):
        conv = store.create_conversation(f"{prefix} chat {i}")
        question = store.add_message(conv.id, None, "user", f"{prefix}-question-{i} " + "why " * 40)
        reply = store.add_message(
            conv.id, question.id, "assistant", f"{prefix}-answer-{i} " + "because " * 60
        )
        made[conv.id] = [question.content, reply.content]
    return made


def _texts(store: Store) -> dict[int, list[str]]:
    return {c.id: [m.content for m in store.messages(c.id)] for c in store.conversations()}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _overwrite(path: Path, offset: int, length: int, seed: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(random.Random(seed).randbytes(length))


@pytest.fixture
def history(tmp_path: Path) -> tuple[Path, dict[int, list[str]], dict[int, list[str]]]:
    """A database with a backup from yesterday holding ``old``, and ``new`` written since."""
    path = tmp_path / "data" / "conversations.sqlite3"
    store, report = open_store(path, now=time.time() - 2 * DAY)
    assert report.backup is not None and not report.recovered  # the first start backs up too
    old = _fill(store, "old", 20)
    store.close()
    store, report = open_store(path, now=time.time() - DAY)
    assert report.backup is not None
    new = _fill(store, "new", 20)
    store.close()  # checkpoints: everything is in the main file now
    assert not Path(str(path) + "-wal").exists()
    return path, old, new


def test_a_damaged_page_is_repaired_from_the_backup_plus_what_the_file_still_holds(history) -> None:
    path, old, new = history
    # Damage the page that holds one of the newest replies (so it is in no backup).
    data = path.read_bytes()
    page = data.index(b"new-answer-10 ") // PAGE
    assert page > 0
    _overwrite(path, page * PAGE, PAGE)
    damaged = _digest(path)
    with pytest.raises(sqlite3.DatabaseError):  # this is what every send would have met
        db = sqlite3.connect(path)
        db.execute("SELECT count(*), group_concat(content) FROM messages").fetchone()
    db.close()
    backups_before = [b.path for b in backups(path)]

    store, report = open_store(path)
    try:
        assert report.recovered and report.problem  # what quick_check said
        # The damaged file is kept aside, byte for byte; nothing named like it was deleted.
        aside = report.damaged_file
        assert aside is not None and aside.name.startswith("conversations.sqlite3.corrupt-")
        assert _digest(aside) == damaged
        # Restored from the newest backup, which was checked first; no backup of the damage made.
        assert report.restored_from == backups_before[0]
        assert [b.path for b in backups(path)] == backups_before
        texts = _texts(store)
        # Everything the backup had is back...
        for cid, messages in old.items():
            assert texts[cid] == messages
        # ...and of the newer work, all but the rows on the damaged page, which are counted.
        new_messages = [m for ms in new.values() for m in ms]
        back = [m for ms in texts.values() for m in ms]
        lost = [m for m in new_messages if m not in back]
        assert 0 < len(lost) <= 15  # one page's worth
        assert all(any(m in ms for ms in new.values()) for m in lost)
        assert report.salvage.tables["messages"].missing >= len(lost)
        assert report.salvage.tables["messages"].added == len(new_messages) - len(lost)
        # A usable database: healthy, searchable (the FTS index follows the merged rows), writable.
        assert integrity_ok(store.db)
        assert store.search("new-question-19")
        conv = store.create_conversation("after repair")
        store.add_message(conv.id, None, "user", "still works")
        # What the user is told names the kept file and the backup.
        message = report.message()
        assert str(aside) in message and report.restored_from.name in message and "lost" in message
    finally:
        store.close()


def test_a_damaged_header_is_rebuilt_and_every_row_salvaged(history) -> None:
    path, old, new = history
    _overwrite(path, 0, 100, seed=1)  # the 100-byte header: SQLite then refuses the whole file
    damaged = _digest(path)
    store, report = open_store(path)
    try:
        assert report.recovered and "not a database" in report.problem
        assert _digest(report.damaged_file) == damaged
        assert report.restored_from is not None
        # Only the header was damaged: every row is back, the newer ones from the damaged file.
        assert _texts(store) == {**old, **new}
        assert report.salvage.tables["messages"].added == 2 * len(new)
        assert report.salvage.count("missing") == 0
        assert integrity_ok(store.db)
    finally:
        store.close()


def test_without_a_usable_backup_it_starts_fresh_and_salvages(history) -> None:
    path, old, new = history
    for backup in backups(path):  # the newest backup is damaged too, the older one is gone
        backup.path.unlink()
    data = path.read_bytes()
    page = data.index(b"old-answer-3 ") // PAGE
    _overwrite(path, page * PAGE, PAGE, seed=2)
    store, report = open_store(path)
    try:
        assert report.started_fresh and report.restored_from is None
        texts = _texts(store)
        everything = [m for ms in {**old, **new}.values() for m in ms]
        back = [m for ms in texts.values() for m in ms]
        assert len(everything) - 15 <= len(back) < len(everything)  # one page lost
        assert set(back) <= set(everything)
        assert "no usable backup" in report.message()
        assert integrity_ok(store.db)
    finally:
        store.close()


def test_a_damaged_backup_is_skipped_for_an_older_good_one(history) -> None:
    path, old, new = history
    newest, older = backups(path)[:2]
    _overwrite(newest.path, PAGE, 2 * PAGE, seed=3)
    assert quick_check(newest.path) != "ok"
    _overwrite(path, 0, 100, seed=4)
    store, report = open_store(path)
    try:
        assert report.restored_from == older.path
        assert _texts(store) == {**old, **new}  # the salvage brings back what the old backup lacks
    finally:
        store.close()


def test_wal_content_is_salvaged_and_the_wal_kept_aside(tmp_path: Path) -> None:
    """A kill leaves the newest rows in the -wal file only: they move aside with the damaged
    database, and the salvage (reading a copy of both) brings them back."""
    path = tmp_path / "conversations.sqlite3"
    store, _ = open_store(path, now=time.time() - DAY)
    old = _fill(store, "old", 20)
    store.close()  # old rows: in the main file
    store, report = open_store(path)  # today's backup: the old rows
    assert report.backup is not None
    new = _fill(store, "walled", 5)
    # Stand in for a kill: the files as they are while the connection is open.
    snapshot = {suffix: Path(str(path) + suffix).read_bytes() for suffix in ("", "-wal")}
    store.close()
    for suffix, data in snapshot.items():
        Path(str(path) + suffix).write_bytes(data)
    assert b"walled-answer-4" in snapshot["-wal"] and b"walled-answer-4" not in snapshot[""]
    page = snapshot[""].index(b"old-answer-5 ") // PAGE
    _overwrite(path, page * PAGE, PAGE, seed=5)
    damaged = _digest(path)
    store, report = open_store(path)
    try:
        assert report.recovered and report.restored_from is not None
        suffixes = [p.name[len(report.damaged_file.name) :] for p in report.moved_aside]
        assert suffixes[0] == "" and "-wal" in suffixes
        assert _digest(report.damaged_file) == damaged
        assert Path(str(report.damaged_file) + "-wal").read_bytes() == snapshot["-wal"]
        assert _texts(store) == {**old, **new}  # the damaged page's rows from the backup, the rest salvaged
        assert report.salvage.tables["messages"].added == 2 * len(new)
    finally:
        store.close()


def test_daily_backups_rotate_and_one_a_day_is_enough(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    start = time.time() - 10 * DAY
    for day in range(5):
        store, report = open_store(path, keep_daily=3, now=start + day * DAY)
        store.create_conversation(f"day {day}")
        assert report.backup is not None
        store.close()
    store, report = open_store(path, keep_daily=3, now=start + 4 * DAY + 60)  # same day again
    store.close()
    assert report.backup is None
    kept = backups(path, "daily")
    assert len(kept) == 3
    # The newest three days; each a complete, healthy copy of the database at that start.
    assert [round((b.taken_at - start) / DAY) for b in kept] == [4, 3, 2]
    for backup, conversations in zip(kept, (4, 3, 2), strict=True):
        assert quick_check(backup.path) == "ok"
        db = sqlite3.connect(backup.path)
        assert db.execute("SELECT count(*) FROM conversations").fetchone()[0] == conversations
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # one self-contained file
        db.close()


def test_a_backup_is_made_before_a_migration(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, target=3)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'Before v4', 1, 1)")
    db.close()
    assert backups(path) == []

    store = Store(path)
    try:
        assert store.db.execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION
        [backup] = backups(path)
        assert backup.kind == "pre-v3"
        copy = sqlite3.connect(backup.path)
        assert copy.execute("PRAGMA user_version").fetchone()[0] == 3  # the state before migrating
        assert copy.execute("SELECT title FROM conversations").fetchall() == [("Before v4",)]
        assert "images" not in {r[0] for r in copy.execute("SELECT name FROM sqlite_master")}
        copy.close()
    finally:
        store.close()
    # Opening an up-to-date database migrates nothing, so it backs nothing up.
    Store(path).close()
    assert len(backups(path)) == 1


def test_a_healthy_database_opens_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    store, _ = open_store(path)
    made = _fill(store, "fine", 3)
    store.close()
    store, report = open_store(path)
    try:
        assert not report.recovered and report.message() == ""
        assert report.moved_aside == [] and _texts(store) == made
        assert not list(tmp_path.glob("*.corrupt-*"))
    finally:
        store.close()
