"""The bar that asks before a tool runs: the call (name and arguments) and three answers."""

from __future__ import annotations

import json

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

ALLOW_ONCE, ALLOW_ALWAYS, DENY = "once", "always", "deny"


def call_summary(name: str, arguments: str, limit: int = 300) -> str:
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        args = arguments
    text = f"{name}({args})"
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ToolApprovalBar(QWidget):
    decided = Signal(str, str)  # call id, ALLOW_ONCE | ALLOW_ALWAYS | DENY

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Tool call approval")
        self.call_id = ""
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setAccessibleName("Tool call")
        self.allow_button = QPushButton("Allow once")
        self.always_button = QPushButton("Always allow this tool")
        self.deny_button = QPushButton("Deny")
        layout.addWidget(self.label, 1)
        for button in (self.allow_button, self.always_button, self.deny_button):
            layout.addWidget(button)
        self.allow_button.clicked.connect(lambda: self._decide(ALLOW_ONCE))
        self.always_button.clicked.connect(lambda: self._decide(ALLOW_ALWAYS))
        self.deny_button.clicked.connect(lambda: self._decide(DENY))
        self.hide()

    def ask(self, call: dict) -> None:
        self.call_id = call["id"]
        self.label.setText(f"The model wants to run {call_summary(call['name'], call['arguments'])}")
        self.always_button.setText(f"Always allow {call['name']}")
        self.show()

    def _decide(self, answer: str) -> None:
        call_id, self.call_id = self.call_id, ""
        self.hide()
        if call_id:
            self.decided.emit(call_id, answer)
