"""The downloads pane: progress shown, pause/resume/cancel buttons act on the engine's queue."""

from __future__ import annotations

import pytest
from fake_hub import FakeHub, PatternBlob

from app.downloads import QtDownloadManager, create_downloads_pane
from app.downloads.model import COLUMNS
from engine.hub import DownloadManager, HubClient, JobState, installed_models
from engine.hub.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.02, jitter=0.0)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        fake.add_repo("org/model", {"config.json": "{}", "model.safetensors": PatternBlob(3 << 20, seed=4)})
        yield fake


@pytest.fixture
def manager(tmp_path, hub):
    m = DownloadManager(tmp_path / "models", client=HubClient(retry=FAST), retry=FAST, progress_interval=0.05)
    yield m
    m.shutdown()


def cell(pane, column: str) -> str:
    return pane.model.index(0, COLUMNS.index(column)).data() or ""


def test_progress_pause_resume_cancel(qtbot, hub, manager, tmp_path):
    hub.fault("model.safetensors", "throttle", rate=1.5e6, times=None)
    pane = create_downloads_pane(manager)
    qtbot.addWidget(pane)
    qt_manager = QtDownloadManager.wrap(manager)
    job = qt_manager.enqueue("org/model")

    qtbot.waitUntil(lambda: pane.model.rowCount() == 1 and cell(pane, "Speed").endswith("/s"), timeout=10_000)
    assert pane.selected_job().id == job  # the new row is selected
    assert cell(pane, "Status") == "Downloading"
    assert cell(pane, "ETA") != "" and "/ 3.0 MiB" in cell(pane, "Size")
    qtbot.waitUntil(lambda: 0 < pane.model.job_at(0).fraction < 1, timeout=10_000)
    assert pane.pause_button.isEnabled() and not pane.resume_button.isEnabled()

    pane.pause_button.click()
    qtbot.waitUntil(lambda: cell(pane, "Status") == "Paused", timeout=10_000)
    paused_at = pane.model.job_at(0).done_bytes
    assert paused_at > 0 and pane.resume_button.isEnabled() and not pane.pause_button.isEnabled()

    pane.resume_button.click()
    qtbot.waitUntil(lambda: pane.model.job_at(0).done_bytes > paused_at, timeout=10_000)
    assert cell(pane, "Status") == "Downloading"

    pane.cancel_button.click()
    qtbot.waitUntil(lambda: cell(pane, "Status") == "Cancelled", timeout=10_000)
    assert not pane.model.job_at(0).dest.exists()
    assert pane.remove_button.isEnabled()
    pane.remove_button.click()
    qtbot.waitUntil(lambda: pane.model.rowCount() == 0, timeout=5_000)


def test_finished_download_shows_complete_and_is_installed(qtbot, hub, manager, tmp_path):
    pane = create_downloads_pane(manager)
    qtbot.addWidget(pane)
    qt_manager = QtDownloadManager.wrap(manager)
    with qtbot.waitSignal(qt_manager.modelInstalled, timeout=20_000):
        qt_manager.enqueue("org/model")
    qtbot.waitUntil(lambda: cell(pane, "Status") == "Completed", timeout=5_000)
    assert cell(pane, "Progress") == "100%"
    assert pane.model.job_at(0).state == JobState.COMPLETED
    assert [m.repo_id for m in installed_models(tmp_path / "models")] == ["org/model"]
    assert pane.open_button.isEnabled() and not pane.cancel_button.isEnabled()


def test_failed_download_shows_the_error(qtbot, hub, manager):
    pane = create_downloads_pane(manager)
    qtbot.addWidget(pane)
    QtDownloadManager.wrap(manager).enqueue("org/missing")
    qtbot.waitUntil(lambda: pane.model.rowCount() == 1 and cell(pane, "Status") == "Failed", timeout=10_000)
    pane.view.selectRow(0)
    assert "org/missing not found" in pane.detail.text()
    assert pane.resume_button.isEnabled()
