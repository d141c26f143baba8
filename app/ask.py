"""``trellis-chat --ask "QUESTION"``: the smoke check of a finished install or bundle.

It starts the real app (window, worker thread, engine), installs the built-in starter model if
needed (offline), loads it, sends the question through the chat pane's controller exactly as the
composer would, prints the reply on stdout and exits: 0 for a non-empty reply, 1 otherwise.
Nothing is faked, so a bundle that answers here has every module, data file and shared library
the first-run path needs. The conversation is stored like any other (use ``--data-dir`` for a
throw-away directory).
"""

from __future__ import annotations

import sys
import time

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from app.main_window import MainWindow


class AskRun(QObject):
    """Drives the window through starter install -> load -> submit -> reply, then quits."""

    def __init__(self, window: MainWindow, question: str, max_new_tokens: int = 64, timeout_s: float = 900):
        super().__init__(window)
        self.window = window
        self.question = question
        self.max_new_tokens = max_new_tokens
        self.exit_code = 1
        self.reply = ""
        self._started = time.monotonic()
        engine = window.engine
        engine.loaded.connect(self._on_loaded)
        engine.loadFailed.connect(self._fail)
        engine.starterFailed.connect(self._fail)
        window.chat.busyChanged.connect(self._on_busy)
        QTimer.singleShot(int(timeout_s * 1000), lambda: self._fail(f"no reply within {timeout_s:.0f} s"))

    def start(self) -> None:
        self._log("installing/loading the starter model")
        self.window.install_starter()

    def _on_loaded(self, info: dict) -> None:
        self._log(f"loaded {info.get('name')} on {info.get('device')}")
        chat = self.window.chat
        chat.new_conversation()
        chat.set_sampling("greedy", {"max_new_tokens": self.max_new_tokens})
        if not chat.submit(self.question):
            self._fail("the question could not be sent")

    def _on_busy(self, busy: bool) -> None:
        if busy:
            return
        items = self.window.chat.model.items()
        reply = items[-1] if items and items[-1].role == "assistant" else None
        if reply is None or reply.error or not reply.content.strip():
            self._fail(reply.error if reply is not None and reply.error else "the reply was empty")
            return
        self.reply = reply.content.strip()
        speed = reply.stats.get("tokens_per_second", 0.0) if reply.stats else 0.0
        self._log(f"replied in {time.monotonic() - self._started:.1f} s ({speed:.1f} tokens/s)")
        print(self.reply, flush=True)
        self.exit_code = 0
        self.window.close()
        QApplication.instance().exit(0)

    def _fail(self, message: str) -> None:
        if self.exit_code == 0:
            return
        self._log(f"failed: {message}")
        self.exit_code = 1
        self.window.close()
        QApplication.instance().exit(1)

    def _log(self, message: str) -> None:
        # Progress on stderr, so stdout carries only the reply.
        print(f"[ask {time.monotonic() - self._started:6.1f}s] {message}", file=sys.stderr, flush=True)
