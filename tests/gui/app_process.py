"""Runs the real main window in its own process for the kill -9 test (not a test module).

Usage: python app_process.py DATA_DIR. It loads the fake model, completes three exchanges,
starts a long fourth reply, prints ``STREAMING`` once part of it has been saved, and keeps
streaming until it is killed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ["TRELLIS_DATA_DIR"] = sys.argv[1]

from fake_engine import FakeEngine, fake_starter, make_model_dir  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app import paths  # noqa: E402
from app.main_window import MainWindow  # noqa: E402
from app.store import Store  # noqa: E402
from app.worker import EngineClient  # noqa: E402


def spin(app: QApplication, until, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        app.processEvents()
        time.sleep(0.001)


def main() -> None:
    app = QApplication([])
    engine_script = FakeEngine(token_delay=1 / 200)
    engine = EngineClient(engine_script.factory, fake_starter, engine_script.sampling)
    store = Store(paths.database_path())
    window = MainWindow(store, engine, paths.models_dir(), hub=False)
    window.show()
    model = make_model_dir(window.models_dir / "fake")
    window.library.refresh()
    window.request_load(str(model))
    spin(app, lambda: engine.is_loaded)
    for i in range(3):
        engine_script.reply = lambda m, i=i: f"Complete answer number {i}."
        window.chat.submit(f"question {i}")
        spin(app, lambda: not window.chat.busy)
    engine_script.reply = lambda m: "streaming forever " * 5000
    window.chat.submit("the question that gets killed")
    spin(app, lambda: store.incomplete_messages() and store.incomplete_messages()[0].content)
    print("STREAMING", window.chat.conversation_id, flush=True)
    spin(app, lambda: False, timeout=60)


if __name__ == "__main__":
    main()
