"""The conversation store: schema migrations, branches, search, export/import, crash safety."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.store import Store, migrations
from app.store.database import integrity_ok
from app.store.export import ImportFormatError, from_json, to_json, to_markdown
from app.store.migrations import LATEST_VERSION, MIGRATIONS, SchemaTooNewError, migrate, statements

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "chat.sqlite3")
    yield s
    s.close()


def test_fresh_database_is_at_latest_version_in_wal_mode(store: Store) -> None:
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_migration_from_v1_keeps_data_and_indexes_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, target=1)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'Old', 1, 1)")
    db.execute(
        "INSERT INTO messages (conversation_id, parent_id, role, content, created_at)"
        " VALUES (1, NULL, 'user', 'ancient pelican question', 1)"
    )
    db.close()

    s = Store(path)
    assert s.db.execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION
    [msg] = s.messages(1)
    assert msg.complete is True and msg.stats == {}  # v3 defaults for existing rows
    assert s.conversation(1).preset == "balanced"
    # v2 rebuilt the full-text index over rows that existed before it.
    assert [h.conversation_id for h in s.search("pelican")] == [1]
    s.close()


def test_database_from_a_newer_app_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {LATEST_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNewError):
        Store(path)


def test_failed_migration_rolls_back_to_previous_version(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "x.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, target=1)
    broken = [MIGRATIONS[0], "CREATE TABLE half_done (x);\nTHIS IS NOT SQL;", *MIGRATIONS[2:]]
    monkeypatch.setattr(migrations, "MIGRATIONS", broken)
    with pytest.raises(sqlite3.OperationalError):
        migrate(db, target=2)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'half_done'").fetchone() is None


def test_statement_splitter_keeps_trigger_bodies_whole() -> None:
    stmts = statements(MIGRATIONS[1])
    assert any(s.startswith("CREATE TRIGGER") and s.rstrip().endswith("END;") for s in stmts)


def test_branches_regenerate_and_edit_keep_every_path(store: Store) -> None:
    c = store.create_conversation("Branches")
    u1 = store.add_message(c.id, None, "user", "Hi")
    a1 = store.add_message(c.id, u1.id, "assistant", "Hello!")
    a1b = store.add_message(c.id, u1.id, "assistant", "Hey there")  # regenerate: sibling
    assert [m.id for m in store.siblings(a1.id)] == [a1.id, a1b.id]
    assert store.conversation(c.id).current_leaf_id == a1b.id

    u2 = store.add_message(c.id, a1.id, "user", "Tell me a joke")
    a2 = store.add_message(c.id, u2.id, "assistant", "Knock knock")
    u2b = store.add_message(c.id, a1.id, "user", "Tell me a poem")  # edit: sibling of u2
    a2b = store.add_message(c.id, u2b.id, "assistant", "Roses are red")

    assert [m.content for m in store.path(a2b.id)] == ["Hi", "Hello!", "Tell me a poem", "Roses are red"]
    # The old branch is still there, and switching to it lands on its newest leaf.
    assert store.latest_leaf(u2.id) == a2.id
    assert [m.content for m in store.path(store.latest_leaf(u2.id))][-1] == "Knock knock"
    assert store.latest_leaf(a1.id) == a2b.id  # newest child of a1 is u2b
    store.set_current_leaf(c.id, a2.id)
    assert [m.id for m in store.current_path(c.id)] == [u1.id, a1.id, u2.id, a2.id]


def test_fts_follows_inserts_updates_and_cascaded_deletes(store: Store) -> None:
    c1 = store.create_conversation("Cooking")
    c2 = store.create_conversation("Travel to Lisbon")
    m = store.add_message(c1.id, None, "user", "How long to boil an egg?")
    store.add_message(c2.id, None, "user", "Best pastries in Lisbon?")
    assert [h.conversation_id for h in store.search("egg")] == [c1.id]
    assert "[egg]" in store.search("egg")[0].snippet
    assert [h.conversation_id for h in store.search("pastr")] == [c2.id]  # prefix while typing
    assert [h.conversation_id for h in store.search("lisbon")] == [c2.id]  # title and body: one hit

    store.update_message(m.id, "How long to poach salmon?")
    assert store.search("egg") == []
    assert [h.conversation_id for h in store.search("salmon")] == [c1.id]

    store.delete_conversation(c1.id)
    assert store.search("salmon") == []
    assert store.db.execute("SELECT count(*) FROM messages").fetchone()[0] == 1
    # FTS syntax in user input is inert, not an error.
    assert store.search('"AND (OR* NEAR') == []


def test_settings_persist_across_reopen(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.sqlite3")
    s.set_setting("theme", "dark")
    s.set_setting("model_folders", ["/a", "/b"])
    s.set_setting("theme", "light")
    s.close()
    s = Store(tmp_path / "s.sqlite3")
    assert s.get_setting("theme") == "light"
    assert s.get_setting("model_folders") == ["/a", "/b"]
    assert s.get_setting("missing", 42) == 42
    s.close()


def _branchy(store: Store) -> int:
    c = store.create_conversation(
        "Export me", system_prompt="Be brief.", preset="precise", sampling={"top_k": 5}
    )
    u = store.add_message(c.id, None, "user", "Show code")
    store.add_message(c.id, u.id, "assistant", "```python\nprint(1)\n```", stats={"tokens_per_second": 12.5})
    store.add_message(c.id, u.id, "assistant", "Here:\n\n```python\nprint(2)\n```")
    return c.id


def test_export_markdown_is_the_visible_branch(store: Store) -> None:
    cid = _branchy(store)
    md = to_markdown(store, cid)
    assert md.startswith("# Export me")
    assert "## System\n\nBe brief." in md
    assert "print(2)" in md and "print(1)" not in md  # only the branch on screen
    assert md.index("## User") < md.index("## Assistant")


def test_export_import_json_round_trip_keeps_the_whole_tree(store: Store, tmp_path: Path) -> None:
    cid = _branchy(store)
    data = json.loads(json.dumps(to_json(store, cid)))  # through real JSON text
    new_id = from_json(store, data)
    assert new_id != cid
    old, new = store.conversation(cid), store.conversation(new_id)
    assert (new.title, new.system_prompt, new.preset, new.sampling) == (
        old.title,
        old.system_prompt,
        old.preset,
        old.sampling,
    )
    strip = [(m.role, m.content, m.complete, m.stats) for m in store.messages(cid)]
    assert [(m.role, m.content, m.complete, m.stats) for m in store.messages(new_id)] == strip
    assert [m.content for m in store.current_path(new_id)] == [m.content for m in store.current_path(cid)]
    # Same tree shape: the two replies are siblings again.
    reply = store.current_path(new_id)[-1]
    assert len(store.siblings(reply.id)) == 2


def test_import_rejects_damaged_files_without_side_effects(store: Store) -> None:
    cid = _branchy(store)
    data = to_json(store, cid)
    before = len(store.conversations())
    with pytest.raises(ImportFormatError):
        from_json(store, {"format": "something else"})
    broken = dict(
        data, messages=[*data["messages"], {"id": 99, "parent_id": 12345, "role": "user", "content": "x"}]
    )
    with pytest.raises(ImportFormatError):
        from_json(store, broken)
    assert len(store.conversations()) == before


_WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from app.store import Store
    s = Store(sys.argv[1])
    c = s.create_conversation("crash")
    parent = None
    for i in range(100000):
        m = s.add_message(c.id, parent, "user" if i % 2 == 0 else "assistant", f"message {i} " + "x" * 500)
        parent = m.id
        # A streaming reply that never completes, saved periodically, like the GUI does.
        if i % 10 == 5:
            r = s.add_message(c.id, parent, "assistant", "", complete=False)
            for k in range(5):
                s.update_message(r.id, "partial " * k)
        print(i, flush=True)
    """
)


def test_kill_during_writes_loses_nothing_committed(tmp_path: Path) -> None:
    db_path = tmp_path / "crash.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db_path), str(REPO)], stdout=subprocess.PIPE, text=True
    )
    reported = -1
    deadline = time.monotonic() + 30
    while reported < 300 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        reported = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert reported >= 300, "writer did not get going"

    s = Store(db_path)
    assert integrity_ok(s.db)
    contents = {m.content.split(" ")[1] for m in s.messages(1) if m.content.startswith("message ")}
    # Every message the writer reported as written (it prints after the commit) is there.
    assert {str(i) for i in range(reported + 1)} <= contents
    assert s.incomplete_messages(), "the interrupted partial replies are kept, marked incomplete"
    s.close()
