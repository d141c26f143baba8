"""The keyboard shortcut overlay (F1 or Ctrl+/): every shortcut the window has, over a dimmed
window, gone with a click, Esc, or the same key again.

The list is read from the window's actions when the overlay opens (menu actions, the navigation
rail's Ctrl+1..5), so it always says what exists, plus the keys that are not actions (Enter sends,
Esc stops a reply).
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QAction, QColor, QKeySequence, QPainter
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QVBoxLayout, QWidget

from app.theme import SPACE_L, SPACE_M, SPACE_S, SPACE_XL, font_for

# Keys the composer and the window handle themselves (no QAction to read them from).
FIXED_KEYS: list[tuple[str, str]] = [
    ("Enter", "Send the message"),
    ("Shift+Enter", "New line in the message"),
    ("Esc", "Stop the reply (or cancel an edit)"),
]


def action_text(action: QAction) -> str:
    """A menu action's text without its mnemonic "&" and trailing ellipsis."""
    return action.text().replace("&&", "\0").replace("&", "").replace("\0", "&").rstrip("…").strip()


def action_keys(action: QAction) -> str:
    """An action's shortcuts as the user types them: "Ctrl+N", "F1 or Ctrl+/"."""
    native = QKeySequence.SequenceFormat.NativeText
    return " or ".join(key.toString(native) for key in action.shortcuts() if not key.isEmpty())


def window_shortcuts(window: QWidget) -> list[tuple[str, str]]:
    """(keys, what they do) for every action under ``window`` with a shortcut, then the fixed keys;
    each key listed once."""
    seen: set[str] = set()
    entries: list[tuple[str, str]] = []
    for action in window.findChildren(QAction):
        keys = action_keys(action)
        if not keys or keys in seen or not action_text(action):
            continue
        seen.add(keys)
        entries.append((keys, action_text(action)))
    for keys, text in FIXED_KEYS:
        if keys not in seen:
            entries.append((keys, text))
    return entries


class ShortcutOverlay(QWidget):
    def __init__(self, window: QWidget) -> None:
        super().__init__(window)
        self.window_ = window
        self.setAccessibleName("Keyboard shortcuts")
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.card = QFrame(self)
        self.card.setFrameShape(QFrame.Shape.StyledPanel)
        self.card.setAutoFillBackground(True)
        column = QVBoxLayout(self.card)
        column.setContentsMargins(SPACE_XL, SPACE_L, SPACE_XL, SPACE_L)
        column.setSpacing(SPACE_M)
        title = QLabel("Keyboard shortcuts")
        title.setFont(font_for("title", title.font()))
        column.addWidget(title)
        self.grid = QGridLayout()
        self.grid.setHorizontalSpacing(SPACE_XL)
        self.grid.setVerticalSpacing(SPACE_S)
        column.addLayout(self.grid)
        hint = QLabel("Press Esc or click anywhere to close.")
        hint.setProperty("role", "muted")
        hint.setFont(font_for("caption", hint.font()))
        column.addWidget(hint)
        self.entries: list[tuple[str, str]] = []
        window.installEventFilter(self)
        self.hide()

    def toggle(self) -> None:
        if self.isVisible():
            self.hide()
        else:
            self.open()

    def open(self) -> None:
        self._fill(window_shortcuts(self.window_))
        self.setGeometry(self.window_.rect())
        self._place_card()
        self.show()
        self.raise_()
        self.setFocus()

    def _fill(self, entries: list[tuple[str, str]]) -> None:
        while self.grid.count():
            item = self.grid.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.entries = entries
        half = (len(entries) + 1) // 2  # two columns of key + description
        key_font = font_for("label", self.font())
        for i, (keys, text) in enumerate(entries):
            row, col = i % half, 2 * (i // half)
            key = QLabel(keys)
            key.setFont(key_font)
            key.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.grid.addWidget(key, row, col)
            self.grid.addWidget(QLabel(text), row, col + 1)
        self.card.adjustSize()

    def _place_card(self) -> None:
        size = self.card.sizeHint()
        self.card.resize(size)
        self.card.move(
            max(0, (self.width() - size.width()) // 2), max(0, (self.height() - size.height()) // 2)
        )

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt naming)
        if watched is self.window_ and event.type() == QEvent.Type.Resize and self.isVisible():
            self.setGeometry(self.window_.rect())
            self._place_card()
        return False

    def event(self, event: QEvent) -> bool:
        # Esc closes the overlay before the window's "stop reply" shortcut sees it.
        if event.type() == QEvent.Type.ShortcutOverride and event.key() == Qt.Key.Key_Escape:
            event.accept()
            return True
        return super().event(event)

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.key() == Qt.Key.Key_Escape:
            self.hide()
            return
        super().keyPressEvent(event)

    def mousePressEvent(self, _event) -> None:  # noqa: N802
        self.hide()

    def paintEvent(self, _event) -> None:  # noqa: N802
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(0, 0, 0, 110))
