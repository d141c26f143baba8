"""A pane as a page of the rail: its title and one line on what it is for above it, with the same
margins on every page."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.theme import SPACE_L, SPACE_S, SPACE_XS, font_for


class TitledPage(QWidget):
    def __init__(self, title: str, subtitle: str, content: QWidget, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName(title)
        self.content = content
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, SPACE_L, 0, 0)
        layout.setSpacing(SPACE_XS)
        self.title = QLabel(title)
        self.title.setFont(font_for("title", self.title.font()))
        self.subtitle = QLabel(subtitle)
        self.subtitle.setProperty("role", "muted")
        self.subtitle.setWordWrap(True)
        # The title lines up with the pane's own content (inside its layout's margin).
        inner = content.layout().contentsMargins().left() if content.layout() is not None else SPACE_S
        for label in (self.title, self.subtitle):
            label.setContentsMargins(inner, 0, inner, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.subtitle)
        layout.addWidget(content, 1)
