"""Acceptance: kill -9 the app at eight moments; each time the database passes integrity_check,
every message completed before the kill is there, a reply that was under way is kept and marked
interrupted, and the restarted app shows the conversation and can go on with it.

The app runs in its own process (``app_process.py``: the real main window, the fake engine), is
driven to the moment, says so with a ``MARK`` line and stays there until the kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from app_process import (
    BRANCH_REPLY,
    EDITED_QUESTION,
    FIRST_TOKEN,
    IMPORTED_MESSAGES,
    KILLED_QUESTION,
    LAST_REPLY,
    MOMENTS,
    OPENING,
    RENAMED,
    STREAMED_REPLY,
)
from gui_helpers import visible_texts, wait_idle

from app import paths
from app.store import Store
from app.store.database import integrity_ok

HERE = Path(__file__).resolve().parent
OPENED = [(role, text) for pair in OPENING for role, text in zip(("user", "assistant"), pair, strict=True)]
AFTER_RESTART = ("after the restart", "Fine after the restart.")
# Uncommitted pages the frozen import must have pushed into the WAL file (it holds ~3 MiB by then;
# everything committed before it is well under 1 MiB).
SPILLED_BYTES = 1 << 20


def kill_at(moment: str, data_dir: Path) -> dict:
    """Run the app to ``moment``, kill -9 it there; returns the facts its marker line gave."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    log = data_dir.parent / "app_process.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "app_process.py"), str(data_dir), moment],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    try:
        # Anything else a library prints to stdout is skipped; EOF (the script died) ends it too.
        line = next((line for line in proc.stdout if line.startswith("MARK ")), "")
        assert line, f"no marker: {log.read_text()[-2000:]}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    # Killed, not ended on its own (a crash or a timeout in the script would be another code).
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    return json.loads(line[len("MARK ") :])


def shown(store: Store, conversation_id: int) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in store.current_path(conversation_id)]


def complete(pairs: list[tuple[str, str]]) -> list[tuple[str, str, bool]]:
    return [(role, text, True) for role, text in pairs]


def check_fts(store: Store) -> None:
    """The search index matches the messages table (raises 'database disk image is malformed'
    when a kill left them out of step: integrity_check does not look inside FTS5 tables)."""
    store.db.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)")


def status(window, row: int) -> str:
    return window.chat_pane.view.message_widget(row).status_label.text()


# -- what each moment must have left in the database --------------------------------------------------


def stored_loading(store: Store, facts: dict) -> None:
    assert shown(store, facts["conversation"]) == complete(OPENED)
    assert store.incomplete_messages() == []
    # The model that never finished loading was not recorded as the one to load at startup.
    assert Path(store.get_setting("library.last_model")).name == "fake"


def stored_reply_under_way(expected_partial):
    """The opening, the killed question (complete) and the reply it was getting: kept, marked
    incomplete, with ``expected_partial(content)`` true of what was saved."""

    def check(store: Store, facts: dict) -> None:
        path = shown(store, facts["conversation"])
        assert path[:-1] == complete([*OPENED, ("user", KILLED_QUESTION)])
        role, content, done = path[-1]
        assert (role, done) == ("assistant", False)
        assert expected_partial(content), content[:200]
        # Nothing else anywhere is left incomplete.
        reply_id = store.current_path(facts["conversation"])[-1].id
        assert [m.id for m in store.incomplete_messages()] == [reply_id]

    return check


def stored_completed(store: Store, facts: dict) -> None:
    last_exchange = [("user", KILLED_QUESTION), ("assistant", LAST_REPLY)]
    assert shown(store, facts["conversation"]) == complete([*OPENED, *last_exchange])
    assert store.current_path(facts["conversation"])[-1].stats["stop_reason"] == "eos"
    assert store.incomplete_messages() == []


def stored_new_conversation(store: Store, facts: dict) -> None:
    first = facts["conversation"]
    titles = {c.id: c.title for c in store.conversations()}
    assert len(titles) == 2 and first in titles, titles
    (second,) = set(titles) - {first}
    assert titles == {first: RENAMED, second: "New chat"}
    assert shown(store, first) == complete(OPENED)
    assert store.messages(second) == []


def stored_branch(store: Store, facts: dict) -> None:
    cid, replaced = facts["conversation"], facts["replaced"]
    path = shown(store, cid)
    assert path[:3] == complete([*OPENED[:2], ("user", EDITED_QUESTION)]) and len(path) == 4
    role, content, done = path[3]
    assert (role, done) == ("assistant", False)
    assert content and BRANCH_REPLY.startswith(content), content[:200]
    edited_id = store.current_path(cid)[2].id
    # The branch the edit replaced is intact, one version back.
    assert [m.id for m in store.siblings(replaced)] == [replaced, edited_id]
    old = store.path(store.latest_leaf(replaced))
    assert [(m.role, m.content, m.complete) for m in old] == complete(OPENED)


def stored_import(store: Store, facts: dict) -> None:
    # All or nothing: the half-written import added no conversation and no message.
    assert [c.id for c in store.conversations()] == [facts["conversation"]]
    assert shown(store, facts["conversation"]) == complete(OPENED)
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == len(OPENED)


STORED = {
    "loading": stored_loading,
    "submitted": stored_reply_under_way(lambda content: content == ""),
    "first_token": stored_reply_under_way(lambda content: content == FIRST_TOKEN),
    "streaming": stored_reply_under_way(lambda content: bool(content) and STREAMED_REPLY.startswith(content)),
    "completed": stored_completed,
    "new_conversation": stored_new_conversation,
    "branch": stored_branch,
    "import": stored_import,
}


# -- what the restarted window must show ------------------------------------------------------------------


def shows_opening(window, facts: dict) -> None:
    assert window.chat.conversation_id == facts["conversation"]
    assert visible_texts(window) == OPENED


def shows_interrupted(window, facts: dict) -> None:
    assert window.chat.conversation_id == facts["conversation"]
    texts = visible_texts(window)
    assert texts[:-1] == [*OPENED, ("user", KILLED_QUESTION)]
    assert texts[-1] == ("assistant", window.store.current_path(facts["conversation"])[-1].content)
    assert status(window, len(texts) - 1) == "interrupted"


def shows_completed(window, facts: dict) -> None:
    assert window.chat.conversation_id == facts["conversation"]
    assert visible_texts(window) == [*OPENED, ("user", KILLED_QUESTION), ("assistant", LAST_REPLY)]
    assert status(window, len(OPENED) + 1) == ""


def shows_new_conversation(window, facts: dict) -> None:
    # The newest conversation opens: the empty one the kill interrupted; both are listed.
    assert window.chat.conversation_id not in (None, facts["conversation"])
    assert visible_texts(window) == []
    listed = window.conversation_model
    titles = [listed.data(listed.index(row)) for row in range(listed.rowCount())]
    assert sorted(titles) == sorted([RENAMED, "New chat"])


def shows_branch(window, facts: dict) -> None:
    assert window.chat.conversation_id == facts["conversation"]
    texts = visible_texts(window)
    assert texts[:3] == [*OPENED[:2], ("user", EDITED_QUESTION)] and len(texts) == 4
    assert texts[3][0] == "assistant" and texts[3][1] and BRANCH_REPLY.startswith(texts[3][1])
    assert window.chat_pane.view.message_widget(2).branch_label.text() == "2/2"
    assert status(window, 3) == "interrupted"
    edited = window.chat.model.items()[2].id
    # The replaced version is one click back, whole; then back to the edit to go on there.
    assert window.chat.switch_branch(edited, -1)
    assert visible_texts(window) == OPENED
    assert window.chat.switch_branch(window.chat.model.items()[2].id, +1)
    assert visible_texts(window) == texts


SHOWN = {
    "loading": shows_opening,
    "submitted": shows_interrupted,
    "first_token": shows_interrupted,
    "streaming": shows_interrupted,
    "completed": shows_completed,
    "new_conversation": shows_new_conversation,
    "branch": shows_branch,
    "import": shows_opening,
}


@pytest.mark.parametrize("moment", MOMENTS)
def test_kill_at_any_moment_loses_nothing_complete(
    moment: str, qtbot, data_dir: Path, make_window, fake_engine
) -> None:
    facts = kill_at(moment, data_dir)
    if moment == "import":
        wal = Path(f"{paths.database_path()}-wal")
        assert wal.stat().st_size > SPILLED_BYTES, "the kill did not land inside a transaction on disk"

    store = Store(paths.database_path())
    try:
        assert integrity_ok(store.db)
        check_fts(store)
        STORED[moment](store, facts)
    finally:
        store.close()

    window = make_window()
    qtbot.waitUntil(lambda: window.engine.is_loaded, timeout=5000)
    # The model loaded at startup is the last one that finished loading before the kill.
    assert window.engine.model_info.name == "fake"
    SHOWN[moment](window, facts)

    before = visible_texts(window)
    fake_engine.reply = lambda _messages: AFTER_RESTART[1]
    assert window.chat.submit(AFTER_RESTART[0])
    wait_idle(qtbot, window)
    assert visible_texts(window) == [*before, ("user", AFTER_RESTART[0]), ("assistant", AFTER_RESTART[1])]
    sent = window.store.current_path(window.chat.conversation_id)[-2:]
    assert [(m.role, m.content, m.complete) for m in sent] == complete(
        [("user", AFTER_RESTART[0]), ("assistant", AFTER_RESTART[1])]
    )
    if moment == "new_conversation":
        # The first message sent after the restart titled the interrupted new chat; the renamed
        # one still holds the opening exchanges.
        assert window.store.conversation(window.chat.conversation_id).title == AFTER_RESTART[0]
        window.chat.open_conversation(facts["conversation"])
        assert visible_texts(window) == OPENED
    if moment == "import":
        # Importing the same file again now works, all of it.
        imported = window.import_conversation(facts["file"])
        assert len(window.store.messages(imported)) == IMPORTED_MESSAGES
