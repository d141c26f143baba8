"""The Edit menu's standard commands (undo, redo, cut, copy, paste, select all), done by whichever
widget has the keyboard focus: the message box, the search field, a message's text.

The menu entries show the standard shortcuts, but typing those keys still goes to the focused
widget first (text widgets claim them through ShortcutOverride), so the menu never changes what
the keys already do; it makes the commands findable and usable with the mouse.

Undo has a second meaning: where the focus is not in text that has something to undo, it brings
back the messages just deleted from the conversation (the window decides, with
``text_undo_available``).
"""

from __future__ import annotations

from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QApplication, QLineEdit, QPlainTextEdit, QTextEdit, QWidget

# (menu text, standard key, the method text widgets have for it)
EDIT_COMMANDS: tuple[tuple[str, QKeySequence.StandardKey, str], ...] = (
    ("&Undo", QKeySequence.StandardKey.Undo, "undo"),
    ("&Redo", QKeySequence.StandardKey.Redo, "redo"),
    ("Cu&t", QKeySequence.StandardKey.Cut, "cut"),
    ("&Copy", QKeySequence.StandardKey.Copy, "copy"),
    ("&Paste", QKeySequence.StandardKey.Paste, "paste"),
    ("Select &All", QKeySequence.StandardKey.SelectAll, "selectAll"),
)


def focused_widget() -> QWidget | None:
    return QApplication.focusWidget()


def run_on_focus(method: str) -> bool:
    """Call ``method`` (e.g. "copy") on the focused widget if it has one; whether it did."""
    widget = focused_widget()
    target = getattr(widget, method, None) if widget is not None else None
    if not callable(target):
        return False
    target()
    return True


def text_undo_available(widget: QWidget | None) -> bool:
    """Whether ``widget`` is editable text with an edit to undo."""
    if isinstance(widget, QLineEdit):
        return not widget.isReadOnly() and widget.isUndoAvailable()
    if isinstance(widget, (QPlainTextEdit, QTextEdit)):
        return not widget.isReadOnly() and widget.document().isUndoAvailable()
    return False
