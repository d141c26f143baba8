"""The whole window offscreen: first run, conversations (new/rename/delete/search), export and
import, restart persistence, shortcuts, accessibility, themes."""

from __future__ import annotations

import json

from gui_helpers import load_model, send, visible_texts
from PySide6.QtCore import Qt
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication, QWidget

from app.conversations.model import SNIPPET_ROLE


def test_first_run_offers_the_starter_model_and_it_chats(qtbot, window) -> None:
    banner = window.chat_pane.starter_banner
    assert banner.isVisible()
    assert window.model_bar.status.text() == "No model loaded"
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        qtbot.mouseClick(banner.install_button, Qt.MouseButton.LeftButton)
    assert not banner.isVisible()
    assert "SmolLM2-135M-Instruct" in window.model_bar.status.text()
    assert window.library_model.rowCount() == 1
    send(qtbot, window, "What is 2+2?")
    assert visible_texts(window)[1][1].startswith("You said: What is 2+2?")


def test_starter_offer_can_be_dismissed_for_good(qtbot, make_window) -> None:
    window = make_window()
    qtbot.mouseClick(window.chat_pane.starter_banner.dismiss_button, Qt.MouseButton.LeftButton)
    assert not window.chat_pane.starter_banner.isVisible()
    window.close()
    assert not make_window().chat_pane.starter_banner.isVisible()


def test_new_rename_delete_conversations(qtbot, window, monkeypatch) -> None:
    load_model(qtbot, window)
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    send(qtbot, window, "about apples")
    qtbot.mouseClick(window.conversations.new_button, Qt.MouseButton.LeftButton)
    send(qtbot, window, "about bananas")
    assert [window.conversation_model.index(r).data() for r in range(2)] == ["about bananas", "about apples"]

    from PySide6.QtWidgets import QInputDialog, QMessageBox

    def answer(dialog: QInputDialog) -> int:  # the user types a new title and presses OK
        dialog.setTextValue("Fruit: bananas")
        return 1

    monkeypatch.setattr(QInputDialog, "exec", answer)
    qtbot.mouseClick(window.conversations.rename_button, Qt.MouseButton.LeftButton)
    assert window.conversation_model.index(0).data() == "Fruit: bananas"
    assert "Fruit: bananas" in window.chat_pane.title_label.text()

    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *a, **k: QMessageBox.StandardButton.Yes))
    qtbot.mouseClick(window.conversations.delete_button, Qt.MouseButton.LeftButton)
    assert window.conversation_model.rowCount() == 1
    assert window.chat.conversation_id is None and window.chat.model.rowCount() == 0

    # Clicking the remaining conversation opens it.
    view = window.conversations.list
    rect = view.visualRect(window.conversation_model.index(0))
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert visible_texts(window)[0] == ("user", "about apples")


def test_ctrl_f_search_finds_message_text(qtbot, window) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "tell me about the platypus")
    window.chat.new_conversation()
    send(qtbot, window, "weather in Oslo")
    window.chat_pane.composer.setFocus()
    qtbot.keyClick(window, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert window.conversations.search.hasFocus()
    qtbot.keyClicks(window.conversations.search, "platyp")
    assert window.conversation_model.rowCount() == 1
    index = window.conversation_model.index(0)
    assert index.data() == "tell me about the platypus"
    # The match, without the store's match marks (the list highlights it instead).
    assert "platypus" in index.data(SNIPPET_ROLE) and "[" not in index.data(SNIPPET_ROLE)
    window.conversations.search.clear()
    assert window.conversation_model.rowCount() == 2


def test_export_and_import_round_trip(qtbot, window, fake_engine, tmp_path) -> None:
    replies = iter(["one", "two"])
    fake_engine.reply = lambda m: next(replies)
    load_model(qtbot, window)
    send(qtbot, window, "branchy")
    window.chat.regenerate()
    qtbot.waitUntil(lambda: not window.chat.busy)
    md = window.export_conversation(tmp_path / "c.md", "md").read_text()
    assert "## User\n\nbranchy" in md and "## Assistant\n\ntwo" in md and "one" not in md
    exported = window.export_conversation(tmp_path / "c.json", "json")
    assert len(json.loads(exported.read_text())["messages"]) == 3

    new_id = window.import_conversation(exported)
    assert window.chat.conversation_id == new_id
    assert visible_texts(window) == [("user", "branchy"), ("assistant", "two")]
    assert window.chat_pane.view.message_widget(1).branch_label.text() == "2/2"
    assert window.conversation_model.rowCount() == 2


def test_restart_finds_everything_again(qtbot, make_window, fake_engine) -> None:
    replies = iter(["alpha", "beta", "gamma"])
    fake_engine.reply = lambda m: next(replies)
    window = make_window()
    load_model(qtbot, window)
    send(qtbot, window, "remember this")
    window.chat.regenerate()
    qtbot.waitUntil(lambda: not window.chat.busy)
    window.chat.switch_branch(window.chat.model.item(1).id, -1)  # look at the first reply
    window.chat.set_system_prompt("Be terse.")
    window.settings.set("appearance.font_size", 13)
    cid = window.chat.conversation_id
    window.close()

    again = make_window()
    assert again.chat.conversation_id == cid
    assert visible_texts(again) == [("user", "remember this"), ("assistant", "alpha")]  # same branch
    assert again.chat_pane.view.message_widget(1).branch_label.text() == "1/2"
    assert again.store.conversation(cid).system_prompt == "Be terse."
    assert again.settings.get("appearance.font_size") == 13
    # The last model is loaded again at startup.
    qtbot.waitUntil(lambda: again.engine.is_loaded, timeout=5000)
    assert "tiny-model" in again.model_bar.status.text()


def test_widgets_have_accessible_names(window) -> None:
    names = {w.accessibleName() for w in window.findChildren(QWidget) if w.accessibleName()}
    for expected in (
        "Message input",
        "Send message",
        "Stop reply",
        "Regenerate last reply",
        "Conversation",
        "Search conversations",
        "Conversation list",
        "New conversation",
        "Model library",
        "Load model",
        "Unload model",
        "Context used",
    ):
        assert expected in names, expected


def test_dark_theme_applies_and_rerenders(qtbot, window) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "code please")
    light_html = window.chat_pane.view.message_widget(1).body.toHtml()
    window.settings.set("appearance.theme", "dark")
    assert window.dark
    assert QApplication.instance().palette().color(QPalette.ColorRole.Window).lightness() < 80
    dark_html = window.chat_pane.view.message_widget(1).body.toHtml()
    assert dark_html != light_html and "#1e1f22" in dark_html
    window.settings.set("appearance.theme", "light")
    assert QApplication.instance().palette().color(QPalette.ColorRole.Window).lightness() > 200


def test_discover_and_downloads_panes_when_their_packages_exist(make_window) -> None:
    try:
        import app.downloads  # noqa: F401
        import app.hub  # noqa: F401
    except ImportError:
        expected = ["chats", "models", "settings"]
    else:
        expected = ["chats", "models", "discover", "downloads", "settings"]
    window = make_window(hub=True)
    assert window.nav.keys() == expected


def test_app_starts_without_the_optional_panes(make_window, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "app.hub", None)  # import of app.hub now raises ImportError
    window = make_window(hub=True)
    assert window.nav.keys() == ["chats", "models", "settings"]
