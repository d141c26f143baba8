"""The window's design: the navigation rail, role blocks with hover actions and times, the model
picker's fit line, the empty states and where their buttons lead, the shortcut overlay, the type
scale and emoji font."""

from __future__ import annotations

import time

import pytest
from fake_engine import make_model_dir
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QAction, QEnterEvent, QFont, QFontDatabase
from PySide6.QtWidgets import QApplication

from app.chat.message_widget import message_time
from app.library.fit import fit_text
from app.shortcut_overlay import window_shortcuts
from app.theme import TYPE_SCALE, font_for, install_emoji_font
from engine.inspect import MemoryVerdict, ModelInfo


def _hub_window(make_window):
    pytest.importorskip("app.hub")
    return make_window(hub=True)


# -- navigation rail ------------------------------------------------------------------------------


def test_the_rail_switches_panes_by_click_and_by_ctrl_number(qtbot, make_window) -> None:
    window = _hub_window(make_window)
    rail = window.nav
    assert rail.keys() == ["chats", "models", "discover", "downloads", "settings"]
    assert rail.current() == "chats" and window.pages.currentWidget() is window.chats_page
    assert rail.buttons["chats"].isChecked()

    qtbot.mouseClick(rail.buttons["downloads"], Qt.MouseButton.LeftButton)
    assert window.pages.currentWidget().isAncestorOf(window.optional_panes["downloads"])
    assert rail.buttons["downloads"].isChecked() and not rail.buttons["chats"].isChecked()

    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window)
    for number, key in enumerate(rail.keys(), start=1):
        qtbot.keyClick(window, getattr(Qt.Key, f"Key_{number}"), Qt.KeyboardModifier.ControlModifier)
        assert rail.current() == key
        assert window.pages.currentWidget() is window.page_for[key]
        assert rail.buttons[key].isChecked()  # the current pane is the highlighted one
    assert rail.buttons["models"].toolTip() == "Models (Ctrl+2)"
    with pytest.raises(KeyError, match="no pane 'nowhere'"):
        rail.select("nowhere")


def test_opening_a_conversation_goes_to_chats(qtbot, window) -> None:
    window.chat.new_conversation()
    window.go_to("settings")
    window.conversations.conversationSelected.emit(window.chat.conversation_id)
    assert window.nav.current() == "chats"


# -- messages --------------------------------------------------------------------------------------


def _hover(widget, inside: bool) -> None:
    if inside:
        point = QPointF(5, 5)
        QApplication.sendEvent(widget, QEnterEvent(point, point, widget.mapToGlobal(point)))
    else:
        QApplication.sendEvent(widget, QEvent(QEvent.Type.Leave))


def test_messages_are_role_blocks_with_actions_and_time_on_hover(qtbot, window) -> None:
    make_model_dir(window.models_dir / "tiny-model")
    window.library.refresh()
    window.request_load(str(window.models_dir / "tiny-model"))
    qtbot.waitUntil(lambda: window.engine.is_loaded, timeout=10_000)
    before = time.time()
    window.chat.submit("hello")
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=10_000)
    user, reply = (window.chat_pane.view.message_widget(row) for row in (0, 1))
    assert (user.avatar.initial, reply.avatar.initial) == ("Y", "A")
    assert user.avatar.color() != reply.avatar.color()
    for widget, actions in (
        (user, ("copy_button", "edit_button", "delete_button")),
        (reply, ("copy_button", "regenerate_button", "delete_button")),
    ):
        for name in actions:  # every action lives in the hover toolbar
            assert widget.actions_bar.isAncestorOf(getattr(widget, name))
            assert getattr(widget, name).isVisibleTo(widget)
        assert not widget.hover_shown()
        _hover(widget, True)
        assert widget.hover_shown()
        _hover(widget, False)
        assert not widget.hover_shown()
    # The time: short beside the name (shown on hover), the full date in the tooltip.
    short, full = message_time(before)
    assert reply.time_label.text() in {short, message_time(time.time())[0]}
    assert reply.role_label.toolTip() and str(time.localtime(before).tm_year) in reply.role_label.toolTip()


def test_other_versions_are_mentioned_when_the_switcher_is_hidden(qtbot, window) -> None:
    make_model_dir(window.models_dir / "tiny-model")
    window.library.refresh()
    window.request_load(str(window.models_dir / "tiny-model"))
    qtbot.waitUntil(lambda: window.engine.is_loaded, timeout=10_000)
    window.chat.submit("hello")
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=10_000)
    window.chat.regenerate()
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=10_000)
    reply = window.chat_pane.view.message_widget(1)
    assert reply.actions_bar.isAncestorOf(reply.prev_button)
    assert "version 2 of 2" in reply.status_label.text()


def test_message_time_texts() -> None:
    now = time.mktime((2026, 6, 15, 18, 0, 0, 0, 0, -1))
    assert message_time(0) == ("", "")
    assert message_time(now - 3600, now)[0] == "17:00"
    earlier = message_time(time.mktime((2026, 3, 5, 9, 7, 0, 0, 0, -1)), now)
    assert earlier[0] == "5 Mar, 09:07" and "March 2026, 09:07:00" in earlier[1]
    assert message_time(time.mktime((2024, 3, 5, 9, 7, 0, 0, 0, -1)), now)[0] == "5 Mar 2024, 09:07"


# -- model picker ----------------------------------------------------------------------------------


def test_the_chat_has_the_model_picker_with_quantization_and_fit(qtbot, window) -> None:
    assert window.chat_pane.isAncestorOf(window.model_bar)
    assert window.model_bar.picker.placeholderText() == "No models yet"
    make_model_dir(window.models_dir / "tiny-model")
    window.library.refresh()
    bar = window.model_bar
    verdict = window.library_model.verdict(0)
    info = window.library_model.infos()[0]
    assert bar.estimate.text() == fit_text(info, verdict)
    assert bar.estimate.text().startswith("F16 · ≈ ")
    assert verdict.verdict in {"fits", "tight", "too big", "unknown"}


def test_fit_text_says_each_verdict() -> None:
    info = ModelInfo(path="/m/x", name="x", quantization="EXL3 4.0 bpw")
    gib = 1 << 30
    assert (
        fit_text(info, MemoryVerdict(gib, 2 * gib, 4 * gib)) == "EXL3 4.0 bpw · ≈ 1.0 GiB · ✓ fits in memory"
    )
    assert "tight" in fit_text(info, MemoryVerdict(3 * gib, 2 * gib, 4 * gib))
    assert "too big" in fit_text(info, MemoryVerdict(5 * gib, 2 * gib, 4 * gib))
    assert fit_text(ModelInfo(path="/m/y", name="y"), MemoryVerdict(gib, 2 * gib, 4 * gib)).startswith(
        "precision unknown"
    )


# -- empty states ----------------------------------------------------------------------------------


def test_no_conversations_says_how_to_start_one(qtbot, window) -> None:
    pane = window.conversations
    assert pane.stack.is_empty() and pane.empty.title.text() == "No conversations yet"
    qtbot.mouseClick(pane.empty.button, Qt.MouseButton.LeftButton)
    assert window.conversation_model.rowCount() == 1 and not pane.stack.is_empty()
    pane.search.setText("zebra")
    assert pane.stack.is_empty() and "zebra" in pane.empty.text.text()
    assert pane.empty.button.isHidden()


def test_no_models_leads_to_discover(qtbot, make_window) -> None:
    window = _hub_window(make_window)
    library = window.library_pane
    assert library.stack.is_empty() and library.empty.button.text() == "Download a model"
    qtbot.mouseClick(library.empty.button, Qt.MouseButton.LeftButton)
    assert window.nav.current() == "discover"
    # The chat says the same, and leads to the same place.
    chat = window.chat_pane
    assert chat.view_stack.is_empty() and chat.empty.button.text() == "Download a model"
    window.go_to("chats")
    qtbot.mouseClick(chat.empty.button, Qt.MouseButton.LeftButton)
    assert window.nav.current() == "discover"
    # With a model that is not loaded, the chat points to Models instead.
    make_model_dir(window.models_dir / "tiny-model")
    window.library.refresh()
    assert not library.stack.is_empty()
    assert chat.empty.title.text() == "No model loaded" and chat.empty.button.text() == "Open Models"
    qtbot.mouseClick(chat.empty.button, Qt.MouseButton.LeftButton)
    assert window.nav.current() == "models"
    window.request_load(str(window.models_dir / "tiny-model"))
    qtbot.waitUntil(lambda: chat.empty.title.text() == "How can I help?", timeout=10_000)
    assert chat.empty.button.isHidden()
    window.chat.submit("hello")
    qtbot.waitUntil(lambda: not chat.view_stack.is_empty(), timeout=10_000)


def test_no_downloads_leads_to_discover(qtbot, make_window) -> None:
    window = _hub_window(make_window)
    downloads = window.optional_panes["downloads"]
    assert downloads.stack.is_empty() and downloads.empty.title.text() == "No downloads"
    qtbot.mouseClick(downloads.empty.button, Qt.MouseButton.LeftButton)
    assert window.nav.current() == "discover"


def test_a_search_with_no_results_says_so_and_clears_the_filters(qtbot, make_window, monkeypatch) -> None:
    window = _hub_window(make_window)
    hub = window.optional_panes["hub"]
    assert hub.stack.is_empty() and hub.empty.title.text() == "Discover models"
    searches = []
    monkeypatch.setattr(hub.controller, "search", searches.append)
    qtbot.mouseClick(hub.empty.button, Qt.MouseButton.LeftButton)  # "Show popular models"
    assert len(searches) == 1
    hub.search_edit.setText("nothing-like-this")
    hub.exl3_check.setChecked(True)
    hub.controller.searchFinished.emit([])
    assert hub.stack.is_empty() and "nothing-like-this" in hub.empty.title.text()
    assert hub.empty.button.text() == "Clear filters"
    searches.clear()
    qtbot.mouseClick(hub.empty.button, Qt.MouseButton.LeftButton)
    assert not hub.exl3_check.isChecked() and not hub.supported_check.isChecked()
    assert len(searches) == 1 and not searches[0].exl3 and not searches[0].supported_only


# -- shortcut overlay, settings pane, theme --------------------------------------------------------


def test_the_shortcut_overlay_lists_the_actions_that_exist(qtbot, window) -> None:
    overlay = window.shortcut_overlay
    assert not overlay.isVisible()
    window.shortcuts_action.trigger()
    assert overlay.isVisible()
    listed = dict(overlay.entries)
    assert listed["Ctrl+1"] == "Go to Chats" and listed["Ctrl+N"] == "New chat"
    assert listed["Ctrl+R"] == "Regenerate reply" and listed["Esc"].startswith("Stop the reply")
    assert listed["F1 or Ctrl+/"] == "Keyboard shortcuts" and "F1" not in listed
    assert overlay.entries == window_shortcuts(window)
    actions = window.findChildren(QAction)
    shortcuts = {key.toString() for action in actions for key in action.shortcuts()}
    for keys, _text in overlay.entries:  # nothing listed that the window does not have
        assert set(keys.split(" or ")) <= shortcuts or keys in {"Enter", "Shift+Enter", "Esc"}
    assert [s.toString() for s in window.shortcuts_action.shortcuts()] == ["F1", "Ctrl+/"]
    qtbot.keyClick(overlay, Qt.Key.Key_Escape)
    assert not overlay.isVisible()


def test_the_settings_pane_applies_a_change_at_once(qtbot, window) -> None:
    page = window.settings_page
    combo = page.editors["appearance.theme"]
    combo.setCurrentIndex(combo.findData("dark"))
    combo.activated.emit(combo.currentIndex())
    assert window.settings.get("appearance.theme") == "dark" and window.dark
    window.settings.set("appearance.font_size", 15)  # changed elsewhere: the pane follows
    assert page.editors["appearance.font_size"].value() == 15


def test_the_type_scale_and_the_emoji_font(qtbot) -> None:
    base = QFont("DejaVu Sans", 10)
    assert font_for("body", base).pointSizeF() == 10
    assert font_for("display", base).pointSizeF() > font_for("title", base).pointSizeF() > 10
    assert font_for("caption", base).pointSizeF() < 10
    assert list(TYPE_SCALE) == ["caption", "body", "label", "title", "display"]
    with pytest.raises(ValueError, match="no text kind 'huge'"):
        font_for("huge", base)
    installed = install_emoji_font()
    if "Noto Color Emoji" in QFontDatabase.families():
        assert installed == "Noto Color Emoji"
        assert "Noto Color Emoji" in QFontDatabase.applicationEmojiFontFamilies()
    else:
        assert installed is None or installed in QFontDatabase.families()
