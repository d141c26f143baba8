"""What the chat shows about the engine belongs to the model and the conversation in view (issue
40, defect 4): an earlier model's error, speed or context figures do not stay on screen."""

from __future__ import annotations

from fake_engine import make_model_dir
from gui_helpers import load_model, send

from engine.errors import ModelLoadError


def test_the_previous_models_error_goes_when_another_model_is_loaded(qtbot, window, fake_engine) -> None:
    fake_engine.load_error = ModelLoadError("model.safetensors: tensor model.norm.weight is truncated")
    broken = make_model_dir(window.models_dir / "broken")
    good = make_model_dir(window.models_dir / "good")
    window.library.refresh()
    with qtbot.waitSignal(window.engine.loadFailed, timeout=5000):
        window.request_load(str(broken))
    assert window.chat_pane.error_label.isVisible() and "truncated" in window.chat_pane.error_label.text()

    fake_engine.load_error = None
    window.request_load(str(good))
    assert not window.chat_pane.error_label.isVisible()  # gone as soon as another model is picked
    qtbot.waitUntil(lambda: window.engine.is_loaded, timeout=5000)
    assert not window.chat_pane.error_label.isVisible()


def test_speed_and_context_follow_the_conversation_and_the_model(qtbot, window, fake_engine) -> None:
    pane = window.chat_pane
    load_model(qtbot, window, "first")
    send(qtbot, window, "hello there")
    assert "tokens/s" in pane.speed_label.text()
    assert pane.context_meter.maximum() == 2048 and pane.context_meter.value() > 0

    # Another conversation: the speed was the other conversation's reply.
    first = window.chat.conversation_id
    window.chat.new_conversation()
    assert pane.speed_label.text() == ""
    qtbot.waitUntil(lambda: pane.context_meter.value() > 0, timeout=3000)  # its own count
    window.conversations.conversationSelected.emit(first)
    assert pane.speed_label.text() == ""

    send(qtbot, window, "and again")
    assert "tokens/s" in pane.speed_label.text()
    # Another model: nothing of the first one's figures stays while it loads, or after.
    fake_engine.context_length = 1024
    fake_engine.load_delay = 0.3
    path = make_model_dir(window.models_dir / "second")
    window.library.refresh()
    window.request_load(str(path))
    assert pane.speed_label.text() == ""
    assert pane.context_meter.format() == "context: no model"
    qtbot.waitUntil(lambda: window.engine.is_loaded, timeout=5000)
    qtbot.waitUntil(lambda: pane.context_meter.maximum() == 1024, timeout=3000)
    assert pane.context_meter.value() > 0 and pane.speed_label.text() == ""

    window.unload_model()
    qtbot.waitUntil(lambda: not window.engine.is_loaded, timeout=3000)
    qtbot.waitUntil(lambda: pane.context_meter.format() == "context: no model", timeout=3000)
