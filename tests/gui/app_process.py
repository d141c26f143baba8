"""Runs the real main window in its own process for the kill -9 tests (not a test module).

Usage: python app_process.py DATA_DIR MOMENT. It loads the fake model, completes the opening
exchange(s), then drives the app to MOMENT (one of ``MOMENTS``), prints one line
``MARK <json>`` (the ids the test needs) and stays at that moment until it is killed.

The app is the real one (MainWindow, ChatController, Store, EngineClient on its own thread); only
the engine is the scripted fake, and two hooks make the moments exact instead of timing-dependent:

- ``Hold`` stops the fake engine's stream after a given number of tokens, so "before the first
  token" and "just after the first token was saved" stay true for as long as the test needs.
- ``freeze_in_store`` stops the GUI thread inside the store, at the start of a chosen SQL
  statement (SQLite's trace callback), so the kill lands in the middle of a store operation: between
  the statements of creating a conversation, or half-way through an import's transaction.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":
    # Run as a script: make the test helpers and the app importable, and use the test's data
    # folder. (Imported by the test for its constants, it must change nothing.)
    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE), str(HERE.parents[1])]
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["TRELLIS_DATA_DIR"] = sys.argv[1]

from fake_engine import FakeEngine, fake_starter, make_model_dir  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app import paths  # noqa: E402
from app.main_window import MainWindow  # noqa: E402
from app.store import Store  # noqa: E402
from app.store.export import to_json  # noqa: E402
from app.worker import EngineClient  # noqa: E402

# What the test expects; it imports these so the two sides cannot drift apart.
OPENING = [("question 0", "Complete answer number 0."), ("question 1", "Complete answer number 1.")]
KILLED_QUESTION = "the question that gets killed"
FIRST_TOKEN = "Partial"
HELD_REPLY = FIRST_TOKEN + " reply that never gets further"
STREAMED_REPLY = "streaming forever " * 5000
LAST_REPLY = "The last answer, complete."
RENAMED = "Renamed before the kill"
EDITED_QUESTION = "question 1, edited"
BRANCH_REPLY = "branch reply " * 5000
SLOW_MODEL = "fake-slow"
IMPORTED_MESSAGES = 600
# The import is frozen this far in: by then its uncommitted pages overflow SQLite's page cache
# (2 MiB) into the WAL file, so the kill leaves half a transaction on disk, not just in memory.
IMPORT_FROZEN_AT = 500
IMPORTED_WORDS = 1200

MOMENTS = (
    "loading",
    "submitted",
    "first_token",
    "streaming",
    "completed",
    "new_conversation",
    "branch",
    "import",
)

# Long enough to outlive the test's kill, short enough that a forgotten process still ends.
STAY_S = 60.0


class Hold:
    """Wraps the fake engine's sessions so a reply can be held after ``after`` tokens (None: never
    held). ``reached`` is set once the engine is holding: the app has sent the request and got
    exactly ``after`` tokens of it."""

    def __init__(self, factory: Callable) -> None:
        self.factory = factory
        self.after: int | None = None
        self.reached = threading.Event()
        self._never = threading.Event()

    def __call__(self, *args, **kwargs):
        session = self.factory(*args, **kwargs)
        stream = session.stream

        def held(*a, **kw):
            for n, chunk in enumerate(stream(*a, **kw)):
                if self.after is not None and n >= self.after:
                    self.reached.set()
                    self._never.wait(STAY_S)
                yield chunk

        session.stream = held
        return session


def mark(**facts) -> None:
    print("MARK", json.dumps(facts), flush=True)


def spin(app: QApplication, until: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        app.processEvents()
        time.sleep(0.001)


def freeze_in_store(store: Store, at: Callable[[str], bool], facts: Callable[[], dict]) -> None:
    """The first time a statement for which ``at(sql)`` is true starts, print the marker and stop
    the GUI thread right there (inside the store call that runs it) until the kill."""

    def trace(sql: str) -> None:
        if at(sql):
            mark(**facts())
            time.sleep(STAY_S)
            # SQLite swallows a callback's exceptions; end the process so the test sees no kill.
            os._exit(3)

    store.db.set_trace_callback(trace)


class App:
    def __init__(self) -> None:
        self.qt = QApplication([])
        self.fake = FakeEngine(token_delay=1 / 200)
        self.hold = Hold(self.fake.factory)
        self.engine = EngineClient(self.hold, fake_starter)
        self.store = Store(paths.database_path())
        self.window = MainWindow(self.store, self.engine, paths.models_dir(), hub=False)
        self.window.show()
        self.chat = self.window.chat

    def load(self, name: str) -> None:
        model = make_model_dir(self.window.models_dir / name)
        self.window.library.refresh()
        self.window.request_load(str(model))

    def exchange(self, question: str, answer: str) -> None:
        self.fake.reply = lambda _messages: answer
        self.chat.submit(question)
        self.wait_idle()

    def wait_idle(self) -> None:
        spin(self.qt, lambda: not self.chat.busy)

    def saved_partial(self) -> str:
        incomplete = self.store.incomplete_messages()
        return incomplete[0].content if incomplete else ""

    def stay(self) -> None:
        spin(self.qt, lambda: False, timeout=STAY_S)


def drive(app: App, moment: str) -> None:
    chat, store, window = app.chat, app.store, app.window
    app.load("fake")
    spin(app.qt, lambda: app.engine.is_loaded)
    for question, answer in OPENING:
        app.exchange(question, answer)
    cid = chat.conversation_id

    if moment == "loading":
        # Switching to a model that takes minutes to load; killed while the engine thread is in it.
        progress: list[str] = []
        app.engine.loadProgress.connect(lambda _fraction, text: progress.append(text))
        app.fake.load_delay = 10 * STAY_S
        app.load(SLOW_MODEL)
        spin(app.qt, lambda: "Loading layer 1/5" in progress)
        mark(conversation=cid)
    elif moment == "submitted":
        app.hold.after = 0
        app.fake.reply = lambda _messages: HELD_REPLY
        chat.submit(KILLED_QUESTION)
        spin(app.qt, app.hold.reached.is_set)
        mark(conversation=cid)
    elif moment == "first_token":
        app.hold.after = 1
        app.fake.reply = lambda _messages: HELD_REPLY
        chat.submit(KILLED_QUESTION)
        spin(app.qt, lambda: app.saved_partial() == FIRST_TOKEN)
        mark(conversation=cid)
    elif moment == "streaming":
        app.fake.reply = lambda _messages: STREAMED_REPLY
        chat.submit(KILLED_QUESTION)
        spin(app.qt, app.saved_partial)
        mark(conversation=cid)
    elif moment == "completed":
        app.exchange(KILLED_QUESTION, LAST_REPLY)
        mark(conversation=cid)
    elif moment == "new_conversation":
        # The user renames this chat from the list, then asks for a new one (File > New chat);
        # frozen once the new row is committed, before the controller has opened it.
        window.conversations.renameRequested.emit(cid, RENAMED)
        created = []

        def after_insert(sql: str) -> bool:
            if created:
                return True
            if sql.startswith("INSERT INTO conversations"):
                created.append(sql)
            return False

        freeze_in_store(store, after_insert, lambda: {"conversation": cid})
        window.new_action.trigger()
        raise SystemExit("the new conversation was never created")
    elif moment == "branch":
        # Editing the second question makes a sibling of it, and a new reply streams under that.
        question_1 = store.current_path(cid)[2]
        app.fake.reply = lambda _messages: BRANCH_REPLY
        chat.edit_message(question_1.id, EDITED_QUESTION)
        spin(app.qt, app.saved_partial)
        mark(conversation=cid, replaced=question_1.id)
    elif moment == "import":
        # A big conversation (a file exported from another machine) imported on the GUI thread:
        # one transaction writing a message per loop turn; frozen half-way through.
        data = to_json(store, cid)
        data["title"] = "Imported"
        data["messages"] = [
            {
                "id": i + 1,
                "parent_id": i or None,
                "role": "user" if i % 2 == 0 else "assistant",
                "content": f"imported message {i} " + "word " * IMPORTED_WORDS,
            }
            for i in range(IMPORTED_MESSAGES)
        ]
        data["current_leaf_id"] = IMPORTED_MESSAGES
        source = Path(sys.argv[1]).parent / "import.json"
        source.write_text(json.dumps(data), encoding="utf-8")
        inserted: set[str] = set()

        def half_way(sql: str) -> bool:
            # A set: SQLite traces one INSERT several times (again for each trigger it runs), and
            # each message's statement text is unique (its content is in it).
            if sql.startswith("INSERT INTO messages "):
                inserted.add(sql)
            return len(inserted) == IMPORT_FROZEN_AT

        freeze_in_store(store, half_way, lambda: {"conversation": cid, "file": str(source)})
        window.import_conversation(source)
        raise SystemExit("the import finished without being frozen")
    else:
        raise SystemExit(f"unknown moment {moment!r}; one of {', '.join(MOMENTS)}")
    app.stay()


def main() -> None:
    drive(App(), sys.argv[2])


if __name__ == "__main__":
    main()
