"""Labels that never make a window wider: a long message (an error with a URL in it, a file path)
must not push the window past the screen's edge, as a plain ``QLabel`` does, since a layout gives
every label at least the width of its text.

``ElidedLabel`` shows one line, cut with "…" to the width it gets, the whole text in its tooltip
(and in ``text()``, as for any label: ``shown_text()`` is what is painted).
``never_widen`` makes a word-wrapped label take the width it is given and wrap (or clip one
unbreakable word) within it.
"""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


def never_widen(label: QLabel) -> QLabel:
    """Let ``label`` have any width its layout gives it (it wraps within it); returns it."""
    label.setWordWrap(True)
    policy = label.sizePolicy()
    policy.setHorizontalPolicy(QSizePolicy.Policy.Ignored)
    label.setSizePolicy(policy)
    return label


class ElidedLabel(QLabel):
    """One line of plain text, elided to fit; ``full_text()`` and the tooltip hold all of it."""

    def __init__(
        self,
        text: str = "",
        parent: QWidget | None = None,
        mode: Qt.TextElideMode = Qt.TextElideMode.ElideRight,
    ) -> None:
        super().__init__(parent)
        self._full = ""
        self._mode = mode
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt naming)
        self._full = text or ""
        self.setToolTip(self._full)
        self._elide()

    def text(self) -> str:
        """The whole text (what is painted may be cut short: ``shown_text``)."""
        return self._full

    def full_text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt naming)
        return QSize(0, super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt naming)
        margins = self.contentsMargins()
        width = self.fontMetrics().horizontalAdvance(self._full) + margins.left() + margins.right() + 2
        return QSize(width, super().sizeHint().height())

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 (Qt naming)
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        margins = self.contentsMargins()
        room = max(0, self.width() - margins.left() - margins.right())
        super().setText(self.fontMetrics().elidedText(self._full, self._mode, room))
