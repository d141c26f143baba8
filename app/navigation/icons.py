"""Line icons drawn with QPainter on a 24-unit grid, in whatever colour the caller's palette gives:
they follow the theme with no image files, and stay sharp at any scale."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPen


def _chats(p: QPainter) -> None:
    path = QPainterPath()
    path.addRoundedRect(QRectF(3, 4, 18, 13), 4, 4)
    p.drawPath(path)
    p.drawPolyline([QPointF(7, 17), QPointF(7, 21), QPointF(11.5, 17)])


def _models(p: QPainter) -> None:
    p.drawPolygon([QPointF(12, 3), QPointF(21, 8), QPointF(12, 13), QPointF(3, 8)])
    p.drawPolyline([QPointF(3, 12.5), QPointF(12, 17.5), QPointF(21, 12.5)])
    p.drawPolyline([QPointF(3, 16.5), QPointF(12, 21.5), QPointF(21, 16.5)])


def _discover(p: QPainter) -> None:
    p.drawEllipse(QPointF(10.5, 10.5), 6.5, 6.5)
    p.drawLine(QPointF(15.5, 15.5), QPointF(21, 21))


def _downloads(p: QPainter) -> None:
    p.drawLine(QPointF(12, 3), QPointF(12, 15))
    p.drawPolyline([QPointF(7, 10), QPointF(12, 15), QPointF(17, 10)])
    p.drawPolyline([QPointF(4, 16.5), QPointF(4, 20.5), QPointF(20, 20.5), QPointF(20, 16.5)])


def _settings(p: QPainter) -> None:
    for y, knob in ((6, 8), (12, 16), (18, 10)):
        p.drawLine(QPointF(3, y), QPointF(knob - 2.5, y))
        p.drawLine(QPointF(knob + 2.5, y), QPointF(21, y))
        p.drawEllipse(QPointF(knob, y), 2.5, 2.5)


ICONS: dict[str, Callable[[QPainter], None]] = {
    "chats": _chats,
    "models": _models,
    "discover": _discover,
    "downloads": _downloads,
    "settings": _settings,
}


def paint_icon(painter: QPainter, name: str, rect: QRectF, color: QColor) -> None:
    """Draw icon ``name`` (a key of ``ICONS``) into ``rect`` with strokes of ``color``."""
    draw = ICONS.get(name)
    if draw is None:
        raise ValueError(f"no icon {name!r} (one of {', '.join(ICONS)})")
    painter.save()
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.translate(rect.topLeft())
    painter.scale(rect.width() / 24, rect.height() / 24)
    pen = QPen(color, 1.8)
    pen.setCapStyle(Qt.PenCapStyle.RoundCap)
    pen.setJoinStyle(Qt.PenJoinStyle.RoundJoin)
    painter.setPen(pen)
    painter.setBrush(Qt.BrushStyle.NoBrush)
    draw(painter)
    painter.restore()
