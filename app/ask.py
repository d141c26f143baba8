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
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal

from app.main_window import MainWindow
from engine.api import ModelInfo


class AskRun(QObject):
    """Drives the window through starter install -> load -> submit -> reply, then closes it and
    emits ``done`` with the exit code (``__main__`` ends the event loop with it)."""

    done = Signal(int)

    def __init__(
        self,
        window: MainWindow,
        question: str,
        max_new_tokens: int = 64,
        timeout_s: float = 900,
        store_wait_s: float = 120,
    ):
        super().__init__(window)
        self.window = window
        self.question = question
        self.max_new_tokens = max_new_tokens
        self.store_wait_s = store_wait_s
        self.exit_code = 1
        self.finished = False
        self.reply = ""
        self._started = time.monotonic()
        # The folder the starter was installed in: the one model this run asks. A load of any
        # other model (one the window restored, say) is not ours to answer with.
        self._starter_path = ""
        engine = window.engine
        engine.starterReady.connect(self._on_starter_ready)
        engine.loaded.connect(self._on_loaded)
        engine.loadFailed.connect(self._fail)
        engine.starterFailed.connect(self._fail)
        window.chat.busyChanged.connect(self._on_busy)
        # Time to first token, for measuring a bundle: the wall-clock time (epoch seconds, to
        # compare with when the program was started) and the time since the question was sent.
        self._asked_at: float | None = None
        self._first_token_logged = False
        engine.chunk.connect(self._on_chunk)
        window.chat.errorOccurred.connect(lambda message: self._log(f"chat: {message}"))
        QTimer.singleShot(int(timeout_s * 1000), lambda: self._fail(f"no reply within {timeout_s:.0f} s"))

    def start(self) -> None:
        self._log("installing/loading the starter model")
        self.window.install_starter()

    def _on_starter_ready(self, path: str) -> None:
        self._starter_path = path
        engine = self.window.engine
        if engine.model_info is not None and self._is_starter(engine.model_info):
            self._on_loaded(engine.model_info)  # restored at startup before the starter was checked

    def _is_starter(self, info: ModelInfo) -> bool:
        return bool(self._starter_path) and Path(info.path).resolve() == Path(self._starter_path).resolve()

    def _on_loaded(self, info: ModelInfo) -> None:
        if not self._is_starter(info):
            self._log(f"ignoring the load of {info.name}: waiting for the starter model")
            return
        self._log(f"loaded {info.name} on {info.device}")
        self._ask_in_new_conversation(time.monotonic() + self.store_wait_s)

    def _ask_in_new_conversation(self, deadline: float) -> None:
        chat = self.window.chat
        # Never into a conversation of the user's: its history would become the question's
        # context. While another program holds the database, try again until ``deadline``.
        if not chat.new_conversation():
            if time.monotonic() > deadline:
                self._fail("the conversation database refused a new conversation")
            else:
                QTimer.singleShot(500, lambda: self._ask_in_new_conversation(deadline))
            return
        chat.set_sampling("greedy", {"max_new_tokens": self.max_new_tokens})
        self._asked_at = time.monotonic()
        if not chat.submit(self.question):
            self._fail("the question could not be sent")

    def _on_chunk(self, _request: int, text: str) -> None:
        if self._first_token_logged or self._asked_at is None or not text:
            return
        self._first_token_logged = True
        waited = time.monotonic() - self._asked_at
        self._log(f"first token at {time.time():.3f} (epoch), {waited:.2f} s after the question")

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
        self.finished = True
        self.window.close()
        self.done.emit(0)

    def _fail(self, message: str) -> None:
        if self.exit_code == 0:
            return
        self._log(f"failed: {message}")
        self.exit_code = 1
        self.finished = True
        self.window.close()
        self.done.emit(1)

    def _log(self, message: str) -> None:
        # Progress on stderr, so stdout carries only the reply.
        print(f"[ask {time.monotonic() - self._started:6.1f}s] {message}", file=sys.stderr, flush=True)
