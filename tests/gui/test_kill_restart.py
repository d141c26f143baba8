"""Acceptance: kill -9 the app while a reply streams; on restart every completed message is
there, the partial reply is kept (marked interrupted), and the database passes integrity_check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from gui_helpers import visible_texts

from app import paths
from app.store import Store
from app.store.database import integrity_ok

HERE = Path(__file__).resolve().parent


def test_kill_during_a_streamed_reply_loses_nothing_complete(qtbot, data_dir: Path, make_window) -> None:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    log = data_dir.parent / "app_process.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "app_process.py"), str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    try:
        line = proc.stdout.readline()
        assert line.startswith("STREAMING"), log.read_text()[-2000:]
        conversation_id = int(line.split()[1])
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL

    store = Store(paths.database_path())
    assert integrity_ok(store.db)
    path = store.current_path(conversation_id)
    complete = [(m.role, m.content) for m in path if m.complete]
    assert complete == [
        ("user", "question 0"),
        ("assistant", "Complete answer number 0."),
        ("user", "question 1"),
        ("assistant", "Complete answer number 1."),
        ("user", "question 2"),
        ("assistant", "Complete answer number 2."),
        ("user", "the question that gets killed"),
    ]
    interrupted = path[-1]
    assert not interrupted.complete and interrupted.content.startswith("streaming forever")
    store.close()

    # The restarted app shows it all, the cut-off reply marked as interrupted, and can go on.
    window = make_window()
    assert window.chat.conversation_id == conversation_id
    assert visible_texts(window)[:7] == complete
    assert window.chat_pane.view.message_widget(7).status_label.text() == "interrupted"
