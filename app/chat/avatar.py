"""A message's avatar: a coloured disc with the role's initial (Y for you, A for the assistant, S for
a system message), so who said what reads at a glance down a long conversation."""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPalette
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.theme import ACCENT_COLORS, font_for

AVATAR_SIZE = 28


def palette_is_dark(palette: QPalette) -> bool:
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


class Avatar(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFixedSize(AVATAR_SIZE, AVATAR_SIZE)
        self.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.role = "assistant"
        self.initial = "A"

    def set_role(self, role: str, name: str) -> None:
        self.role, self.initial = role, (name[:1] or "?").upper()
        self.update()

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt naming)
        return QSize(AVATAR_SIZE, AVATAR_SIZE)

    def color(self) -> QColor:
        light, dark = ACCENT_COLORS.get(self.role, ACCENT_COLORS["system"])
        return QColor(dark if palette_is_dark(self.palette()) else light)

    def paintEvent(self, _event) -> None:  # noqa: N802
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(self.color())
        painter.drawEllipse(QRectF(0.5, 0.5, AVATAR_SIZE - 1, AVATAR_SIZE - 1))
        painter.setPen(QColor("#ffffff"))
        painter.setFont(font_for("label", self.font()))
        painter.drawText(QRectF(0, 0, AVATAR_SIZE, AVATAR_SIZE), Qt.AlignmentFlag.AlignCenter, self.initial)
