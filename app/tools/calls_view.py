"""A reply's tool calls under its text: one line per call (name, arguments, outcome), its result
folded away until the line is clicked."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QToolButton, QVBoxLayout, QWidget

from app.tools.approval import call_summary

STATUS_WORDS = {
    "pending": "waiting",
    "running": "running",
    "done": "done",
    "error": "failed",
    "denied": "denied",
}


class ToolCallsView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Tool calls")
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 2, 0, 2)
        self.shown: list[dict] = []
        self.toggles: list[QToolButton] = []
        self.results: list[QLabel] = []

    def set_calls(self, calls: list[dict]) -> None:
        if calls == self.shown:
            return
        self.shown = [dict(c) for c in calls]
        while self._layout.count():
            widget = self._layout.takeAt(0).widget()
            if widget is not None:
                widget.deleteLater()
        self.toggles, self.results = [], []
        for call in calls:
            toggle = QToolButton(self)
            toggle.setCheckable(True)
            toggle.setAutoRaise(True)
            toggle.setArrowType(Qt.ArrowType.RightArrow)
            toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
            status = STATUS_WORDS.get(call.get("status", ""), call.get("status", ""))
            toggle.setText(f"Tool call {call_summary(call['name'], call['arguments'], 120)}: {status}")
            toggle.setAccessibleName("Tool call result toggle")
            result = QLabel(call.get("result") or "(no result yet)")
            result.setWordWrap(True)
            result.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            result.setAccessibleName("Tool call result")
            result.hide()
            toggle.toggled.connect(lambda on, r=result, t=toggle: self._fold(on, r, t))
            self._layout.addWidget(toggle)
            self._layout.addWidget(result)
            self.toggles.append(toggle)
            self.results.append(result)
        self.setVisible(bool(calls))

    @staticmethod
    def _fold(on: bool, result: QLabel, toggle: QToolButton) -> None:
        result.setVisible(on)
        toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
