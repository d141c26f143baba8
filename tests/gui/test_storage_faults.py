"""The store failing under the chat: a full disk mid-reply, another program holding the write lock,
and a data folder that cannot be written. The reply must stay on screen, the chat must not stay
busy, the user must be told once, nothing may block the GUI thread, and the text must reach the
database once the disk or the lock allows."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fake_engine import default_reply
from gui_helpers import load_model, send, visible_texts, wait_idle

from app.chat import controller as controller_module
from app.crash import LOG_FILE, CrashReporter
from app.store.recovery import StoreOpenError, open_store


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The app backs off to 15 s between attempts; tests should not wait that long.
    monkeypatch.setattr(controller_module, "RETRY_MAX_MS", 400)


def _saved_branch(db_path: Path, conversation_id: int) -> list[tuple[str, str, bool]]:
    """The conversation as a separate connection (another process, say) reads it from the file."""
    db = sqlite3.connect(db_path)
    try:
        (leaf,) = db.execute(
            "SELECT current_leaf_id FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        rows = []
        while leaf is not None:
            parent, role, content, complete = db.execute(
                "SELECT parent_id, role, content, complete FROM messages WHERE id = ?", (leaf,)
            ).fetchone()
            rows.append((role, content, bool(complete)))
            leaf = parent
        return rows[::-1]
    finally:
        db.close()


def _errors(window) -> list[str]:
    seen: list[str] = []
    window.chat.errorOccurred.connect(seen.append)
    return seen


def test_a_full_disk_mid_reply_keeps_the_reply_and_saves_it_later(qtbot, window, fake_engine) -> None:
    fake_engine.reply = lambda m: "A long answer, word by word. " * 80
    fake_engine.token_delay = 0.006
    load_model(qtbot, window)
    errors = _errors(window)
    store, chat = window.store, window.chat
    send(qtbot, window, "please answer", wait=False)
    cid = chat.conversation_id

    # Let a partial save happen first, so the failure is really in the middle of the reply.
    def partly_saved() -> bool:
        path = store.current_path(cid)
        return len(path) == 2 and bool(path[1].content) and not path[1].complete

    qtbot.waitUntil(partly_saved, timeout=5000)
    assert chat.busy

    real_update, real_add = store.update_message, store.add_message
    calls = {"n": 0}

    def full(*_args, **_kwargs):
        calls["n"] += 1
        raise sqlite3.OperationalError("database or disk is full")

    store.update_message = full
    store.add_message = full
    wait_idle(qtbot, window)

    expected = "A long answer, word by word. " * 80
    # Not busy, the whole reply on screen, and the user told (once) why it is not saved.
    assert not chat.busy and window.chat_pane.send_button.isEnabled()
    assert visible_texts(window)[-1] == ("assistant", expected)
    assert window.chat_pane.error_label.isVisible(), (
        errors,
        window.chat_pane.error_label.text(),
        chat.unsaved,
    )
    assert "disk is full" in window.chat_pane.error_label.text()
    assert chat.unsaved > 0
    saved = _saved_branch(store.db_path, cid)
    assert saved[-1][2] is False and saved[-1][1] != expected  # only the partial text is on disk
    # Retries keep failing quietly (no message per attempt, no exception: pytest-qt would fail).
    attempts = calls["n"]
    qtbot.waitUntil(lambda: calls["n"] >= attempts + 2, timeout=5000)
    assert sum("disk is full" in e for e in errors) == 1

    # Space is freed: the retry timer saves the finished reply without any user action.
    store.update_message, store.add_message = real_update, real_add
    qtbot.waitUntil(lambda: chat.unsaved == 0, timeout=5000)
    assert _saved_branch(store.db_path, cid) == [
        ("user", "please answer", True),
        ("assistant", expected, True),
    ]
    assert not window.chat_pane.error_label.isVisible()  # the notice goes once it is all saved
    assert store.current_path(cid)[1].stats["stop_reason"] == "eos"


def test_a_message_sent_while_the_disk_is_full_is_saved_in_order_later(qtbot, window, fake_engine) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "first")
    store, chat = window.store, window.chat
    cid = chat.conversation_id

    real_add = store.add_message

    def full(*_args, **_kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    store.add_message = full
    send(qtbot, window, "second")  # neither the question nor the reply can be stored
    assert [i.content for i in chat.model.items()][-2:] == ["second", default_reply([{"content": "second"}])]
    assert all(i.id < 0 for i in chat.model.items()[-2:])  # provisional ids until stored
    # The conversation goes on: the engine saw the unsaved question, and a third send works too.
    send(qtbot, window, "third")
    sent = [m["content"] for m in fake_engine.calls[-1]["messages"]]
    assert sent[-3:] == ["second", default_reply([{"content": "second"}]), "third"]
    assert visible_texts(window)[-2][1] == "third"

    store.add_message = real_add
    qtbot.waitUntil(lambda: chat.unsaved == 0, timeout=5000)
    branch = _saved_branch(store.db_path, cid)
    assert [content for _, content, _ in branch] == [
        "first",
        default_reply([{"content": "first"}]),
        "second",
        default_reply([{"content": "second"}]),
        "third",
        default_reply([{"content": "third"}]),
    ]
    # The window now shows the stored ids, so branch actions work on them.
    assert [i.id for i in chat.model.items()] == [m.id for m in store.current_path(cid)]
    assert chat.regenerate()
    wait_idle(qtbot, window)


def test_a_locked_database_delays_saving_without_blocking(qtbot, window, fake_engine, monkeypatch) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "before the lock")
    store, chat = window.store, window.chat
    cid = chat.conversation_id
    errors = _errors(window)

    # Another program takes the write lock (and would keep it for a long time).
    locker = sqlite3.connect(store.db_path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        started = time.perf_counter()
        assert chat.submit("during the lock")
        submit_took = time.perf_counter() - started
        wait_idle(qtbot, window)
        # One 50 ms wait for the lock (the reply's write then queues behind it without waiting)
        # plus rendering the two new messages; the old 5 s busy timeout would show here.
        assert submit_took < 0.15
        expected = default_reply([{"content": "during the lock"}])
        assert visible_texts(window)[-2:] == [("user", "during the lock"), ("assistant", expected)]
        assert any("Saving delayed" in e and "another program" in e for e in errors)
        assert chat.unsaved > 0
        # A retry while still locked also returns at once, and says nothing new.
        started = time.perf_counter()
        assert chat.retry_saves() is False
        assert time.perf_counter() - started < 0.1
        assert len(errors) == 1
        assert len(_saved_branch(store.db_path, cid)) == 2
    finally:
        locker.execute("COMMIT")
        locker.close()

    qtbot.waitUntil(lambda: chat.unsaved == 0, timeout=5000)
    assert _saved_branch(store.db_path, cid)[-2:] == [
        ("user", "during the lock", True),
        ("assistant", expected, True),
    ]


def test_the_lock_of_another_process_does_not_hang_a_send(qtbot, window, fake_engine, tmp_path) -> None:
    """Same with the lock held by a separate process (what a second app instance would do)."""
    load_model(qtbot, window)
    send(qtbot, window, "hello")
    chat, store = window.chat, window.store
    script = (
        "import sqlite3, sys, time\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.readline()\n"
        "db.execute('COMMIT')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(store.db_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        send(qtbot, window, "while another process writes")
        assert not chat.busy and chat.unsaved > 0
    finally:
        proc.communicate("\n", timeout=10)
    qtbot.waitUntil(lambda: chat.unsaved == 0, timeout=5000)
    assert store.current_path(chat.conversation_id)[-2].content == "while another process writes"


def test_unsaved_messages_are_written_to_an_importable_file_at_exit(qtbot, window, fake_engine) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "keep me")
    store, chat = window.store, window.chat

    def full(*_args, **_kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    real_add = store.add_message
    store.add_message = full
    send(qtbot, window, "do not lose me")
    chat.shutdown()
    store.add_message = real_add
    [rescued] = list(Path(os.environ["TRELLIS_DATA_DIR"]).glob("unsaved-*.json"))
    imported = window.import_conversation(rescued)
    texts = [m.content for m in store.current_path(imported)]
    assert texts[-2:] == ["do not lose me", default_reply([{"content": "do not lose me"}])]
    assert texts[0] == "keep me"


def test_unsaved_messages_come_back_at_the_next_start(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    load_model(qtbot, window)
    store, chat = window.store, window.chat

    def full(*_args, **_kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    real_add = store.add_message
    store.add_message = full
    send(qtbot, window, "do not lose me")
    chat.shutdown()
    store.add_message = real_add
    window.close()
    data = Path(os.environ["TRELLIS_DATA_DIR"])
    [rescued] = list(data.glob("unsaved-*.json"))

    again = make_window()
    titles = [c.title for c in again.store.conversations()]
    assert any(title.endswith("(unsaved)") for title in titles), titles
    restored = next(c for c in again.store.conversations() if c.title.endswith("(unsaved)"))
    assert [m.content for m in again.store.current_path(restored.id)][0] == "do not lose me"
    assert not rescued.exists() and rescued.with_name(rescued.name + ".restored").is_file()
    assert "Restored 1 conversation" in again.statusBar().currentMessage()
    third = make_window()  # restored once, not at every start
    assert len(third.store.conversations()) == len(titles)


# -- a real full disk and a real read-only folder (tmpfs; skipped where mounting is not allowed) --


def _mount(target: Path, options: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True
        )
    except OSError:
        return False
    return done.returncode == 0


def _unmount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def small_disk(data_dir: Path):
    """The data folder on a 2 MiB tmpfs (only root, or a sandbox that allows mounts, can)."""
    if not _mount(data_dir, "size=2m"):
        pytest.skip("cannot mount a tmpfs here")
    yield data_dir
    _unmount(data_dir)


def _fill_disk(folder: Path) -> Path:
    """Write a file until the disk has no byte left."""
    filler = folder / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    if os.write(fd, b"\0" * size) < size:
                        break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


def test_a_real_full_disk(qtbot, small_disk, make_window, fake_engine) -> None:
    window = make_window()
    fake_engine.reply = lambda m: "Filling the disk, " * 200
    load_model(qtbot, window)
    send(qtbot, window, "warm up")
    store, chat = window.store, window.chat
    cid = chat.conversation_id
    filler = _fill_disk(small_disk)
    errors = _errors(window)
    send(qtbot, window, "a question on a full disk")
    expected = "Filling the disk, " * 200
    assert not chat.busy and visible_texts(window)[-1] == ("assistant", expected)
    assert chat.unsaved > 0
    assert any("disk is full" in e for e in errors), errors  # SQLite's own SQLITE_FULL
    filler.unlink()
    qtbot.waitUntil(lambda: chat.unsaved == 0, timeout=5000)
    assert _saved_branch(store.db_path, cid)[-2:] == [
        ("user", "a question on a full disk", True),
        ("assistant", expected, True),
    ]


def test_a_read_only_data_folder(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """A data folder mounted read-only: the store says so in words and logs go elsewhere."""
    if not _mount(data_dir, "size=1m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        store, _ = open_store(data_dir / "conversations.sqlite3")
        store.close()
        if subprocess.run(["mount", "-o", "remount,ro", str(data_dir)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        with pytest.raises(StoreOpenError, match="cannot be written|Could not open"):
            open_store(data_dir / "conversations.sqlite3")
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
        (tmp_path / "tmp").mkdir()
        reporter = CrashReporter(data_dir / "logs").install()
        try:
            assert reporter.directory == tmp_path / "tmp" / "trellis-chat-logs"
            assert reporter.unwritable_directory == data_dir / "logs"
        finally:
            reporter.uninstall()
    finally:
        _unmount(data_dir)


# -- the crash reporter when the data folder cannot be written ----------------------------------------


@pytest.mark.qt_no_exception_capture
def test_crash_reporter_falls_back_to_the_temp_folder(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "x" / "file.txt"
    blocker.parent.mkdir()
    blocker.write_text("a file where a folder should be")
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(blocker / "sub"))  # mkdir fails even for root
    monkeypatch.delenv("TRELLIS_LOG_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = tmp_path / "tmp" / "trellis-chat-logs"

    reporter = CrashReporter().install()  # must not raise
    try:
        assert reporter.directory == fallback
        assert reporter.unwritable_directory == blocker / "sub" / "logs"
        logging.getLogger("trellis.test").warning("a line for the fallback log")
        log_text = (fallback / LOG_FILE).read_text(encoding="utf-8")
        assert "a line for the fallback log" in log_text
        assert "cannot be written" in log_text  # the log says where it went and why
        try:
            raise RuntimeError("reported from an unwritable data folder")
        except RuntimeError:
            report = reporter.report(sys.exc_info(), where="the test")
        assert report is not None and report.parent == fallback
        assert "reported from an unwritable data folder" in report.read_text(encoding="utf-8")
    finally:
        reporter.uninstall()


def test_damage_found_while_running_is_reported_once_and_nothing_crashes(
    qtbot, data_dir, make_window
) -> None:
    """A page the startup check never saw (damaged while the app runs, or an app version without
    the check): every send used to fail silently. Now the user is told, once, what is wrong and
    what to do; the reply still shows; and at exit it is written to an importable file."""
    from app import paths
    from app.store import Store

    path = paths.database_path()
    store = Store(path)
    for i in range(3):
        conv = store.create_conversation(f"chat {i}")
        store.add_message(conv.id, None, "user", f"question-{i} " + "words " * 100)
    store.close()
    data = path.read_bytes()
    page = data.index(b"question-2 ") // 4096  # the last leaf of the message table
    with open(path, "r+b") as f:
        f.seek(page * 4096)
        f.write(bytes(range(256)) * 16)

    window = make_window()  # opens the newest conversation: its page is the damaged one
    chat = window.chat
    errors = _errors(window)
    assert "damaged" in window.chat_pane.error_label.text()
    load_model(qtbot, window)
    chat.new_conversation()  # the conversation table is intact
    send(qtbot, window, "hello after the damage")  # the new message goes on the damaged page
    assert not chat.busy
    reply = default_reply([{"content": "hello after the damage"}])
    assert visible_texts(window) == [("user", "hello after the damage"), ("assistant", reply)]
    saving = [e for e in errors if "Could not save" in e]
    assert len(saving) == 1 and "damaged" in saving[0] and "Restart Trellis Chat" in saving[0]
    told = len(errors)
    attempts = []
    real_add = window.store.add_message

    def counted(*args, **kwargs):
        attempts.append(1)
        return real_add(*args, **kwargs)

    window.store.add_message = counted
    qtbot.waitUntil(lambda: len(attempts) >= 2, timeout=5000)  # it retried, quietly
    assert len(errors) == told and chat.unsaved > 0

    chat.shutdown()
    [rescued] = list(data_dir.glob("unsaved-*.json"))
    assert "hello after the damage" in rescued.read_text(encoding="utf-8")
