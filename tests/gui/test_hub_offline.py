"""The Hub pane without a network (issue 40, defect 2): "no network" is said in the pane within
seconds with a Retry button, a search can be cancelled, being offline is logged once, and no
message, however long, makes the window wider."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from fake_hub import FakeHub, tiny_llama_config

from app.hub import create_hub_pane
from engine.hub import DownloadManager, HubClient


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def make_pane(qtbot, tmp_path, client: HubClient):
    manager = DownloadManager(tmp_path / "models", client=client, autostart=False)
    pane = create_hub_pane(manager, client=client)
    qtbot.addWidget(pane)
    pane.show()
    return pane, manager


def test_offline_search_says_no_network_in_seconds_and_retry_works(qtbot, tmp_path, no_token, caplog) -> None:
    client = HubClient(endpoint=f"http://127.0.0.1:{closed_port()}")  # the default retry policy
    pane, manager = make_pane(qtbot, tmp_path, client)
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    pane.search_edit.setText("llama")
    pane.run_search()
    assert pane.cancel_button.isVisible()  # the search can be given up while it waits
    qtbot.waitUntil(lambda: pane.notice.isVisible(), timeout=10_000)
    assert time.monotonic() - started < 10
    assert "No network" in pane.notice_label.text() and pane.retry_button.isVisible()
    assert pane.status.text().startswith("Offline") and not pane.cancel_button.isVisible()
    assert "Loading" not in pane.status.text()
    # Failing again is not logged again.
    pane.retry_button.click()
    qtbot.waitUntil(lambda: pane.notice.isVisible(), timeout=10_000)
    offline_logs = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(offline_logs) == 1
    assert [r for r in caplog.records if "Retrying" in r.getMessage()] == []

    # The network comes back: Retry finds the models.
    with FakeHub() as hub:
        hub.add_repo("org/llama-tiny", {"config.json": json.dumps(tiny_llama_config())}, downloads=5)
        client._endpoint = hub.endpoint
        pane.retry_button.click()
        qtbot.waitUntil(lambda: pane.results.rowCount() == 1, timeout=10_000)
    assert not pane.notice.isVisible() and pane.status.text() == "1 models"
    manager.shutdown()


def test_a_search_can_be_cancelled(qtbot, tmp_path, no_token) -> None:
    release = threading.Event()

    class SlowClient(HubClient):
        def search(self, query):
            release.wait(10)
            return []

    pane, manager = make_pane(qtbot, tmp_path, SlowClient(endpoint="http://127.0.0.1:1"))
    pane.run_search()
    assert pane.controller.busy and pane.cancel_button.isVisible()
    pane.cancel_button.click()
    assert not pane.controller.busy and not pane.cancel_button.isVisible()
    assert pane.status.text() == "Cancelled"
    release.set()
    qtbot.wait(200)
    assert pane.status.text() == "Cancelled"  # the late answer is dropped
    manager.shutdown()


def test_no_message_widens_the_window(qtbot, make_window, monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    window = make_window(hub=True)
    window.resize(1280, 800)
    qtbot.waitExposed(window)
    pane = window.optional_panes["hub"]
    window.go_to("discover")
    long_message = "cannot reach https://huggingface.co/api/models?search=llama&limit=200 " * 6
    pane.controller.failed.emit(long_message)  # as a failure of any request reports itself
    qtbot.wait(100)
    assert window.width() == 1280
    pane.run_search()  # and a real one: no network
    qtbot.waitUntil(lambda: pane.notice.isVisible(), timeout=10_000)
    qtbot.wait(100)
    assert window.width() == 1280
    window.go_to("chats")
    window.chat_pane.show_error("Could not load /a/very/long/path/" + "x" * 400)
    qtbot.wait(100)
    assert window.width() == 1280
