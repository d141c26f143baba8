"""The app's serve switch with the starter model (SmolLM2-135M): the loaded model answers the
official ``openai`` client on 127.0.0.1 while the app chats with it, both through one engine loop
(one model, one cache, one continuous batch); the address is shown with a Copy button; turning
the switch off stops the server and gives the app its Generator back."""

from __future__ import annotations

import socket
import threading

import httpx2
import openai
import pytest
from gui_helpers import send, visible_texts, wait_idle
from PySide6.QtGui import QGuiApplication


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def real_window(qtbot, data_dir):
    from app import paths
    from app.main_window import MainWindow
    from app.store import Store
    from app.worker import EngineClient

    store = Store(paths.database_path())
    engine = EngineClient()
    window = MainWindow(store, engine, paths.models_dir(), hub=False, autoload=False)
    qtbot.addWidget(window)
    window.show()
    yield window
    window.close()
    store.close()


@pytest.mark.slow
def test_serve_the_loaded_model_beside_the_apps_chats(qtbot, real_window, smollm2_dir):
    window = real_window
    with qtbot.waitSignal(window.engine.loaded, timeout=120000):
        window.engine.load(str(smollm2_dir), "cpu", (16, 16), 2048)
    port = free_port()
    window.settings.set("serve.port", port)
    assert window.serve.action.text() == f"Serve the loaded model on localhost:{port}"
    with qtbot.waitSignal(window.engine.serveStarted, timeout=30000) as started:
        window.serve.action.trigger()
    url = started.args[0]
    assert url == f"http://127.0.0.1:{port}/v1"
    assert window.serve.status.isVisible() and url in window.serve.status.label.text()
    window.serve.status.copy_button.click()
    assert QGuiApplication.clipboard().text() == url

    session = window.engine.worker._session
    assert type(session.generator).__name__ == "LoopedGenerator"  # the app's replies join the loop
    loop = window.serve.engine.worker._server.server.engine
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    (model,) = [m.id for m in client.models.list().data]
    assert model == smollm2_dir.name

    # An HTTP client and the app's chat at the same time.
    replies: list[str] = []

    def ask() -> None:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
        )
        replies.append(reply.choices[0].message.content)

    thread = threading.Thread(target=ask)
    window.chat.new_conversation()
    window.chat.set_sampling("greedy", {"max_new_tokens": 8})
    steps_before = loop.steps
    thread.start()
    send(qtbot, window, "What is the capital of France?", wait=False)
    wait_idle(qtbot, window, timeout=300000)
    thread.join(300)
    role, text = visible_texts(window)[-1]
    assert role == "assistant" and text.strip()
    assert replies and replies[0].strip()
    assert loop.steps > steps_before

    with qtbot.waitSignal(window.engine.serveStopped, timeout=30000):
        window.serve.action.trigger()
    assert not window.serve.status.isVisible()
    assert type(session.generator).__name__ == "Generator"
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(f"{url}/models", timeout=5)
    # The app goes on without the server.
    send(qtbot, window, "And of Spain?", wait=False)
    wait_idle(qtbot, window, timeout=300000)
    assert visible_texts(window)[-1][0] == "assistant"


def test_serving_without_a_model_says_to_load_one(qtbot, window):
    with qtbot.waitSignal(window.engine.serveFailed, timeout=5000) as failed:
        window.serve.action.trigger()
    assert "Load a model first" in failed.args[0]
    assert not window.serve.action.isChecked()


def test_a_session_without_a_local_generator_is_not_served(qtbot, window, fake_engine):
    from gui_helpers import load_model

    load_model(qtbot, window)  # the scripted session has no Generator of its own
    with qtbot.waitSignal(window.engine.serveFailed, timeout=5000) as failed:
        window.serve.action.trigger()
    assert "Could not serve" in failed.args[0] and "loaded on this machine" in failed.args[0]
