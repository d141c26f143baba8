"""Shared fixtures for the GUI tests: offscreen Qt, a scripted engine, a fresh data directory.

Every test gets its own data directory (``TRELLIS_DATA_DIR``), so nothing touches the user's real
conversations and tests never see each other's state.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from fake_engine import FakeEngine, fake_starter  # noqa: E402  (needs the platform set first)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "data"
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(path))
    return path


@pytest.fixture
def engine_client(qtbot, fake_engine: FakeEngine):
    from app.worker import EngineClient

    client = EngineClient(session_factory=fake_engine.factory, starter_factory=fake_starter)
    yield client
    client.shutdown()


@pytest.fixture
def store(data_dir: Path):
    from app import paths
    from app.store import Store

    s = Store(paths.database_path())
    yield s
    s.close()


@pytest.fixture
def make_window(qtbot, data_dir: Path, fake_engine: FakeEngine):
    """Build a MainWindow on the test's data dir with the fake engine; closes them all at the end."""
    from app import paths
    from app.main_window import MainWindow
    from app.store import Store
    from app.worker import EngineClient

    made = []

    def make(hub: bool = False):
        store = Store(paths.database_path())
        engine = EngineClient(session_factory=fake_engine.factory, starter_factory=fake_starter)
        window = MainWindow(store, engine, paths.models_dir(), hub=hub)
        qtbot.addWidget(window)
        window.show()
        made.append((window, store))
        return window

    yield make
    for window, store in made:
        window.close()
        store.close()


@pytest.fixture
def asked(monkeypatch) -> list[str]:
    """Answers Yes to every ``QMessageBox.question`` and keeps the questions' texts."""
    from PySide6.QtWidgets import QMessageBox

    questions: list[str] = []

    def question(_parent, _title, text, *_args, **_kwargs):
        questions.append(text)
        return QMessageBox.StandardButton.Yes

    monkeypatch.setattr(QMessageBox, "question", staticmethod(question))
    return questions


@pytest.fixture
def window(make_window):
    return make_window()
