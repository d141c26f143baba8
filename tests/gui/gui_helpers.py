"""Small steps the GUI tests share: load the fake model, send a message, wait for the reply."""

from __future__ import annotations

from fake_engine import make_model_dir
from PySide6.QtCore import Qt


def load_model(qtbot, window, name: str = "tiny-model") -> str:
    path = make_model_dir(window.models_dir / name)
    window.library.refresh()
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(path))
    return str(path)


def send(qtbot, window, text: str, wait: bool = True) -> None:
    """Type ``text`` in the composer and press Enter, as a user would."""
    composer = window.chat_pane.composer
    composer.setFocus()
    composer.setPlainText(text)
    qtbot.keyClick(composer, Qt.Key.Key_Return)
    if wait:
        wait_idle(qtbot, window)


def wait_idle(qtbot, window, timeout: int = 5000) -> None:
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=timeout)


def visible_texts(window) -> list[tuple[str, str]]:
    return [(item.role, item.content) for item in window.chat.model.items()]
