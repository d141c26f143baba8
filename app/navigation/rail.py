"""The navigation rail: one button per pane (icon over label) down the window's left edge, the
current pane highlighted, Ctrl+1..Ctrl+9 to switch.

A view: it shows which pane is current and emits ``currentChanged(key)`` when the user picks one;
the window owns the pages and switches them. Each button's shortcut is a ``QAction`` of the rail
(window-wide), so the shortcut overlay finds and lists it like any menu action.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QAction, QColor, QKeySequence, QPainter, QPalette
from PySide6.QtWidgets import QButtonGroup, QSizePolicy, QToolButton, QVBoxLayout, QWidget

from app.navigation.icons import paint_icon
from app.theme import SPACE_S, SPACE_XS, font_for

RAIL_WIDTH = 76
ICON_SIZE = 22


@dataclass(frozen=True)
class Destination:
    key: str  # the pane's name in code ("chats"); also its icon's name
    label: str  # what the button says ("Chats")


class RailButton(QToolButton):
    """A checkable button painted as an icon over a label, a pill behind the icon when current."""

    def __init__(self, destination: Destination, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.destination = destination
        self.setCheckable(True)
        self.setAutoRaise(True)
        self.setText(destination.label)
        self.setAccessibleName(destination.label)
        # Reached from the keyboard by Ctrl+1..9, not Tab: no focus ring on a click.
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setFont(font_for("caption", self.font()))
        self.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt naming)
        return QSize(
            RAIL_WIDTH - 2 * SPACE_XS, ICON_SIZE + 2 * SPACE_S + self.fontMetrics().height() + SPACE_S
        )

    def paintEvent(self, _event) -> None:  # noqa: N802
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = self.palette()
        accent = palette.color(QPalette.ColorRole.Highlight)
        text = palette.color(QPalette.ColorRole.WindowText)
        pill = QRectF((self.width() - 52) / 2, SPACE_XS, 52, ICON_SIZE + 2 * SPACE_XS + 2)
        if self.isChecked() or self.underMouse():
            fill = QColor(accent)
            fill.setAlpha(60 if self.isChecked() else 28)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(fill)
            painter.drawRoundedRect(pill, pill.height() / 2, pill.height() / 2)
        color = accent if self.isChecked() else text
        icon = QRectF((self.width() - ICON_SIZE) / 2, pill.center().y() - ICON_SIZE / 2, ICON_SIZE, ICON_SIZE)
        paint_icon(painter, self.destination.key, icon, color)
        font = self.font()
        font.setBold(self.isChecked())
        painter.setFont(font)
        painter.setPen(color if self.isChecked() else text)
        label = QRectF(0, pill.bottom() + SPACE_XS, self.width(), self.fontMetrics().height() + 2)
        painter.drawText(label, Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop, self.text())


class NavigationRail(QWidget):
    currentChanged = Signal(str)

    def __init__(self, destinations: list[Destination], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        if not destinations:
            raise ValueError("a navigation rail needs at least one destination")
        self.setAccessibleName("Navigation")
        self.setFixedWidth(RAIL_WIDTH)
        self.setAutoFillBackground(True)
        self.setBackgroundRole(QPalette.ColorRole.Window)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(SPACE_XS, SPACE_S, SPACE_XS, SPACE_S)
        layout.setSpacing(SPACE_XS)
        self.group = QButtonGroup(self)
        self.group.setExclusive(True)
        self.buttons: dict[str, RailButton] = {}
        self.actions_by_key: dict[str, QAction] = {}
        for number, destination in enumerate(destinations, start=1):
            button = RailButton(destination, self)
            self.group.addButton(button)
            self.buttons[destination.key] = button
            if destination.key == "settings":
                layout.addStretch(1)  # settings sits at the bottom, apart from the panes
            layout.addWidget(button, 0, Qt.AlignmentFlag.AlignHCenter)
            button.clicked.connect(lambda _checked=False, key=destination.key: self._picked(key))
            if number <= 9:
                action = QAction(f"Go to {destination.label}", self)
                action.setShortcut(QKeySequence(f"Ctrl+{number}"))
                action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
                action.triggered.connect(lambda _checked=False, key=destination.key: self._picked(key))
                self.addAction(action)
                self.actions_by_key[destination.key] = action
                keys = action.shortcut().toString(QKeySequence.SequenceFormat.NativeText)
                button.setToolTip(f"{destination.label} ({keys})")
        if "settings" not in self.buttons:
            layout.addStretch(1)
        self._current = ""
        self.select(destinations[0].key)

    def current(self) -> str:
        return self._current

    def keys(self) -> list[str]:
        return list(self.buttons)

    def select(self, key: str) -> None:
        """Make ``key`` current (and say so if it changed); an unknown key is an error."""
        if key not in self.buttons:
            raise KeyError(f"no pane {key!r} in the navigation rail (one of {', '.join(self.buttons)})")
        self.buttons[key].setChecked(True)
        if key != self._current:
            self._current = key
            self.currentChanged.emit(key)

    def _picked(self, key: str) -> None:
        self.select(key)
