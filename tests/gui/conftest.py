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

    client = EngineClient(
        session_factory=fake_engine.factory,
        starter_factory=fake_starter,
        sampling_factory=fake_engine.sampling,
    )
    yield client
    client.shutdown()
