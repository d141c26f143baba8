"""Layout and the small things (issue 40, defect 7): elided texts instead of clipped ones or
sideways scrolling, dates in the conversation list, a rename dialog a title fits in, exports that
start in the documents folder (then the last one used), readable error colours on both themes,
search matches highlighted, delete and show-in-folder in the library, a full Edit menu."""

from __future__ import annotations

import time
from pathlib import Path

from fake_engine import make_model_dir
from gui_helpers import load_model, send
from PySide6.QtCore import QStandardPaths, Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.conversations.highlight import highlight_html, strip_snippet_marks
from app.conversations.model import DATE_ROLE, SNIPPET_ROLE, _age
from app.theme import ERROR_COLORS, _palette

LONG = "A very long conversation title about Rust lifetimes, borrowing and the async runtime in depth"


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours."""

    def luminance(colour: str) -> float:
        c = QColor(colour)
        channels = []
        for v in (c.redF(), c.greenF(), c.blueF()):
            channels.append(v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4)
        r, g, b_ = channels
        return 0.2126 * r + 0.7152 * g + 0.0722 * b_

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_long_texts_are_elided_not_clipped_or_scrolled(qtbot, window) -> None:
    window.resize(1280, 800)
    window.chat.new_conversation()
    window.chat.rename_conversation(window.chat.conversation_id, LONG)
    qtbot.wait(50)
    listing = window.conversations.list
    assert listing.horizontalScrollBarPolicy() == Qt.ScrollBarPolicy.ScrollBarAlwaysOff
    assert not listing.horizontalScrollBar().isVisible()
    assert window.chat_pane.title_label.text() == LONG
    title = window.chat_pane.title_label
    assert title.fontMetrics().horizontalAdvance(title.shown_text()) <= title.width()
    # A long load message: the progress bar shows only its percentage, the text is elided.
    bar = window.model_bar
    bar.set_loading("a-model-with-a-really-long-name-" * 4)
    bar.set_progress(0.42, "Loading layer 17/32 of the decoder and its mixture of experts " * 2)
    qtbot.wait(50)
    assert bar.progress.format() == "%p%"
    assert bar.status.shown_text().endswith("…") and "layer 17/32" in bar.status.toolTip()
    assert window.width() == 1280


def test_the_conversation_list_shows_dates(qtbot, window) -> None:
    window.chat.new_conversation()
    window.chat.rename_conversation(window.chat.conversation_id, "today's chat")
    window.conversations.refresh()
    index = window.conversation_model.index(0)
    assert index.data(DATE_ROLE) == "just now"
    delegate = window.conversations.delegate
    assert delegate is window.conversations.list.itemDelegate()
    now = time.time()
    assert _age(now - 600, now) == "10 min ago"
    day = 86400
    assert _age(now - 400 * day, now).count("-") == 2  # a date (YYYY-MM-DD) for last year's


def test_the_rename_dialog_fits_a_long_title(qtbot, window) -> None:
    dialog = window.conversations.make_rename_dialog(LONG)
    qtbot.addWidget(dialog)
    dialog.show()
    assert dialog.width() >= 480 and dialog.textValue() == LONG


def test_exports_start_in_the_documents_folder_then_the_last_one(
    qtbot, window, tmp_path, monkeypatch
) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "export me")
    documents = Path(QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation))
    proposed = window.export_default_path("md")
    assert proposed.parent == documents and proposed.name == "export me.md"
    assert proposed.parent != Path.cwd() or documents == Path.cwd()

    asked = []

    def save_dialog(parent, caption, directory, filt):
        asked.append(directory)
        return str(tmp_path / "exports" / "chat.md"), filt

    (tmp_path / "exports").mkdir()
    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(save_dialog))
    window._export_dialog("md")
    assert asked == [str(documents / "export me.md")]
    assert (tmp_path / "exports" / "chat.md").read_text().count("export me") >= 1
    assert window.export_default_path("json").parent == tmp_path / "exports"  # the last one used


def test_error_colours_are_readable_on_both_themes(qtbot, window) -> None:
    for dark in (False, True):
        palette = _palette(dark)
        for role in (QPalette.ColorRole.Window, QPalette.ColorRole.Base):
            assert contrast(ERROR_COLORS[dark], palette.color(role).name()) >= 4.5
    label = window.chat_pane.error_label
    assert label.palette().color(QPalette.ColorRole.WindowText).name() == ERROR_COLORS[False]
    window.settings.set("appearance.theme", "dark")
    assert label.palette().color(QPalette.ColorRole.WindowText).name() == ERROR_COLORS[True]
    window.chat_pane.show_error("Something failed")
    image = window.chat_pane.error_label.grab().toImage()
    colours = {image.pixelColor(x, y).name() for x in range(image.width()) for y in range(image.height())}
    assert any(contrast(c, ERROR_COLORS[True]) < 1.3 for c in colours)  # drawn in the dark theme's red
    window.settings.set("appearance.theme", "light")


def test_search_matches_are_highlighted(qtbot, window) -> None:
    assert strip_snippet_marks("a [platypus] and [x]", ["platyp"]) == "a platypus and [x]"
    assert highlight_html("The Platypus <3", ["platyp"]).count("<b ") == 1
    assert "&lt;3" in highlight_html("The Platypus <3", ["platyp"])
    load_model(qtbot, window)
    send(qtbot, window, "tell me about the platypus")
    window.chat.new_conversation()
    send(qtbot, window, "weather in Oslo")
    window.conversations.search.setText("platyp")
    assert window.conversation_model.index(0).data(SNIPPET_ROLE).count("platypus") >= 1
    window.conversations.conversationSelected.emit(window.conversation_model.ids()[0])
    qtbot.waitUntil(lambda: window.chat_pane.view.highlighted() >= 2, timeout=3000)  # message + reply
    window.conversations.search.clear()
    assert window.chat_pane.view.highlighted() == 0


def test_the_library_can_delete_a_model_and_show_its_folder(qtbot, window, monkeypatch) -> None:
    keep = make_model_dir(window.models_dir / "keep-me")
    doomed = make_model_dir(window.models_dir / "delete-me")
    window.library.refresh()
    pane = window.library_pane
    opened = []
    import app.crash

    monkeypatch.setattr(app.crash, "open_folder", lambda path: opened.append(path) or True)
    pane.select_path(str(doomed))
    qtbot.mouseClick(pane.show_button, Qt.MouseButton.LeftButton)
    assert opened == [doomed]

    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *a, **k: QMessageBox.StandardButton.No))
    qtbot.mouseClick(pane.delete_button, Qt.MouseButton.LeftButton)
    assert doomed.exists()  # the user said no
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *a, **k: QMessageBox.StandardButton.Yes))
    qtbot.mouseClick(pane.delete_button, Qt.MouseButton.LeftButton)
    assert not doomed.exists() and [i.name for i in window.library_model.infos()] == ["keep-me"]

    # The loaded model is not deleted from under the engine.
    told = []
    monkeypatch.setattr(QMessageBox, "information", staticmethod(lambda *a, **k: told.append(a[2])))
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(keep))
    pane.select_path(str(keep))
    qtbot.mouseClick(pane.delete_button, Qt.MouseButton.LeftButton)
    assert keep.exists() and "unload it first" in told[0]


def test_the_edit_menu_has_the_standard_commands(qtbot, window) -> None:
    menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Edit")
    texts = [a.text() for a in menu.actions() if not a.isSeparator()]
    assert texts == ["&Undo", "&Redo", "Cu&t", "&Copy", "&Paste", "Select &All", "&Find in conversations…"]
    composer = window.chat_pane.composer
    composer.setFocus()
    composer.setPlainText("copy this")
    qtbot.waitUntil(composer.hasFocus, timeout=2000)
    window.edit_actions["selectAll"].trigger()
    window.edit_actions["copy"].trigger()
    assert QGuiApplication.clipboard().text() == "copy this"
    window.edit_actions["cut"].trigger()
    assert composer.toPlainText() == ""
    window.edit_actions["paste"].trigger()
    window.edit_actions["paste"].trigger()
    assert composer.toPlainText() == "copy thiscopy this"
    window.edit_actions["undo"].trigger()
    assert composer.toPlainText() == "copy this"


def test_table_columns_are_not_cut_off(qtbot, window) -> None:
    window.resize(1280, 800)
    make_model_dir(window.models_dir / "SmolLM2-135M-Instruct-with-a-long-name")
    broken = make_model_dir(window.models_dir / "broken", architecture="MambaForCausalLM")
    (broken / "tokenizer.json").unlink()
    window.library.refresh()
    window.go_to("models")
    qtbot.wait(50)
    table = window.library_pane.table
    header = table.horizontalHeader()
    assert not table.horizontalScrollBar().isVisible()
    for column in range(1, header.count()):  # every column but the (elided) name fits its text
        assert header.sectionSize(column) >= table.sizeHintForColumn(column)
