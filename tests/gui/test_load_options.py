"""The model's load options (issue 40): context memory in words, 8-bit by default, out of the
toolbar; the library's memory estimate is for the context the model is really loaded with; folders
that hold no model are not listed as models; a base model is answered by plain-text completion."""

from __future__ import annotations

import json
from pathlib import Path

from fake_engine import make_model_dir
from gui_helpers import load_model, send, wait_idle
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel

from app.library.model import COLUMNS


def choose(combo, bits: tuple[int, int]) -> None:
    """Pick the entry for ``bits`` as a user does (``activated`` comes from interaction)."""
    index = combo.findData(f"{bits[0]}/{bits[1]}")
    combo.setCurrentIndex(index)
    combo.activated.emit(index)


def with_context(path: Path, tokens: int) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = tokens
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_context_memory_is_a_load_option_in_words(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    options = window.library_pane.load_options
    labels = [options.memory.itemText(i) for i in range(options.memory.count())]
    assert labels == ["Full precision", "Compact (8-bit, recommended)", "Smallest (4-bit)"]
    assert options.cache_bits() == (8, 8)  # the default
    # The toolbar has no cache jargon any more.
    toolbar_text = " ".join(label.text() for label in window.model_bar.findChildren(QLabel))
    assert "KV" not in toolbar_text and "cache" not in toolbar_text.lower()

    path = with_context(make_model_dir(window.models_dir / "roomy"), 65536)
    window.library.refresh()
    window.library_pane.select_path(str(path))
    row = window.library_model.row_of(str(path))
    memory = window.library_model.index(row, COLUMNS.index("Memory"))
    compact, compact_column = window.library_model.verdict(row).needed_bytes, memory.data()
    assert "at 8,192 tokens" in options.estimate.text()

    choose(options.memory, (16, 16))
    full = window.library_model.verdict(row).needed_bytes
    assert full > compact and memory.data() != compact_column
    choose(options.memory, (4, 4))
    assert window.library_model.verdict(row).needed_bytes < compact
    assert window.store.get_setting("engine.cache_bits_k") == 4
    assert window.store.get_setting("engine.cache_bits_v") == 4
    assert "smallest (4-bit)" in window.model_bar.estimate.toolTip()

    window.model_bar.select_path(str(path))
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        qtbot.mouseClick(window.library_pane.load_button, Qt.MouseButton.LeftButton)
    assert fake_engine.load_options[-1]["cache_bits"] == (4, 4)
    assert "context memory smallest (4-bit)" in window.model_bar.status.text()
    window.close()

    # A restart shows (and uses) the same choice.
    again = make_window()
    assert again.library_pane.load_options.cache_bits() == (4, 4)
    load_model(qtbot, again)
    assert fake_engine.load_options[-1]["cache_bits"] == (4, 4)


def test_the_estimate_is_for_the_context_the_model_is_loaded_with(qtbot, make_window, fake_engine) -> None:
    # Before: the library estimated 4,096 tokens while the engine loaded 8,192.
    fake_engine.context_length = 65536
    window = make_window()
    big = with_context(make_model_dir(window.models_dir / "long-context"), 65536)
    small = make_model_dir(window.models_dir / "short-context")  # its own limit: 2,048
    window.library.refresh()
    model = window.library_model
    for path, context in ((big, 8192), (small, 2048)):
        info = model.infos()[model.row_of(str(path))]
        assert model.verdict(model.row_of(str(path))).needed_bytes == info.memory_needed(
            context, model.device, model.cache_bits
        )
        with qtbot.waitSignal(window.engine.loaded, timeout=5000):
            window.request_load(str(path))
        assert fake_engine.load_options[-1]["context"] == context
        assert window.engine.model_info.context_length == context

    # Changing the context length changes both the estimate and the next load.
    options = window.library_pane.load_options
    options.context.setValue(16384)
    options.context.editingFinished.emit()
    row = model.row_of(str(big))
    info = model.infos()[row]
    assert model.verdict(row).needed_bytes == info.memory_needed(16384, model.device, model.cache_bits)
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(big))
    assert fake_engine.load_options[-1]["context"] == 16384


def test_folders_that_hold_no_model_are_not_listed_as_models(qtbot, window) -> None:
    make_model_dir(window.models_dir / "real-model")
    adapter = window.models_dir / "my-lora-adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    no_arch = window.models_dir / "just-a-config"
    no_arch.mkdir()
    (no_arch / "config.json").write_text("{}")
    (no_arch / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    window.library.refresh()
    names = [info.name for info in window.library_model.infos()]
    assert names == ["real-model"]
    assert window.model_bar.picker.count() == 1
    note = window.library_pane.not_models
    assert not note.isHidden() and note.property("role") == "muted"
    assert "my-lora-adapter (weights without a config.json)" in note.text()
    assert "just-a-config (a config.json that names no model architecture)" in note.text()


def test_a_base_model_is_answered_by_plain_text_completion(qtbot, window, fake_engine) -> None:
    # Before: "no chat template ... use plain completion instead", and no such mode.
    fake_engine.chat_template = False
    fake_engine.reply = lambda messages: " there was a fox."
    load_model(qtbot, window, "base-model")
    notice = window.chat_pane.mode_notice
    assert notice.isVisible() and "Plain-text completion" in notice.text()
    assert "plain-text completion" in window.model_bar.status.text()
    send(qtbot, window, "Once upon a time")
    wait_idle(qtbot, window)
    call = fake_engine.calls[-1]
    assert call["completion"] is True
    assert [i.content for i in window.chat.model.items()] == ["Once upon a time", " there was a fox."]
    assert not window.chat_pane.error_label.isVisible()
    # The context meter counts the plain text too.
    qtbot.waitUntil(lambda: window.chat_pane.context_meter.value() > 0, timeout=3000)

    fake_engine.chat_template = True
    load_model(qtbot, window, "chat-model")
    assert not window.chat_pane.mode_notice.isVisible()
