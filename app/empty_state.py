"""An empty state: what a pane shows instead of an empty list, saying what would be here and how
to get it (a headline, a sentence, and at most one action button).

A view: its button emits ``actionRequested``; whoever placed it decides what that does (open the
Discover pane, start a chat). ``EmptyStack`` puts one in front of a list and shows whichever of
the two applies.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QPushButton, QStackedWidget, QVBoxLayout, QWidget

from app.theme import SPACE_L, SPACE_S, SPACE_XL, font_for

# The widest a guidance sentence gets, so it reads as a paragraph on a wide window.
TEXT_WIDTH = 460


class EmptyState(QWidget):
    actionRequested = Signal()

    def __init__(self, title: str, text: str, action: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Empty state")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(SPACE_XL, SPACE_XL, SPACE_XL, SPACE_XL)
        layout.setSpacing(SPACE_S)
        layout.addStretch(1)
        self.title = QLabel(title)
        self.title.setFont(font_for("display", self.font()))
        self.title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.title.setWordWrap(True)
        self.text = QLabel(text)
        self.text.setProperty("role", "muted")
        self.text.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.text.setWordWrap(True)
        self.text.setTextFormat(Qt.TextFormat.PlainText)
        self.button = QPushButton(action)
        self.button.setAccessibleName(action)
        self.button.setVisible(bool(action))
        self.button.setDefault(True)
        self.button.clicked.connect(self.actionRequested)
        layout.addWidget(self.title)
        layout.addWidget(self.text)
        layout.addSpacing(SPACE_L)
        layout.addWidget(self.button, 0, Qt.AlignmentFlag.AlignHCenter)
        layout.addStretch(2)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt naming)
        """The text keeps to a column at most TEXT_WIDTH wide, centred (the side margins grow)."""
        side = max(SPACE_XL, (self.width() - TEXT_WIDTH) // 2)
        self.layout().setContentsMargins(side, SPACE_XL, side, SPACE_XL)
        super().resizeEvent(event)

    def set_message(self, title: str, text: str, action: str | None = None) -> None:
        """Change what it says; ``action`` "" hides the button, None keeps it as it is."""
        self.title.setText(title)
        self.text.setText(text)
        if action is not None:
            self.button.setText(action)
            self.button.setAccessibleName(action)
            self.button.setVisible(bool(action))


class EmptyStack(QStackedWidget):
    """A content widget (a list, a table) and its empty state, one shown at a time."""

    def __init__(self, content: QWidget, empty: EmptyState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.content, self.empty = content, empty
        self.addWidget(content)
        self.addWidget(empty)

    def set_empty(self, empty: bool) -> None:
        self.setCurrentWidget(self.empty if empty else self.content)

    def is_empty(self) -> bool:
        return self.currentWidget() is self.empty
