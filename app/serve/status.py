"""The window's serve switch: a checkable action ("Serve the loaded model on localhost:PORT")
and, while the server runs, its address with a Copy button in the status bar.

The switch stays on across model changes: the server stops with the model it served and starts
again on the next one loaded. A start that fails (the port is taken) turns it off and says why.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolButton, QWidget

from app.worker import EngineClient


class ServeStatus(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Local server")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.label = QLabel()
        self.label.setAccessibleName("Local server address")
        self.copy_button = QToolButton()
        self.copy_button.setText("Copy")
        self.copy_button.setAccessibleName("Copy the server address")
        self.copy_button.clicked.connect(self.copy)
        layout.addWidget(self.label)
        layout.addWidget(self.copy_button)
        self.url = ""
        self.hide()

    def show_url(self, url: str) -> None:
        self.url = url
        self.label.setText(f"Serving at {url}")
        self.label.setToolTip("OpenAI-compatible API of the loaded model (this machine only)")
        self.show()

    def clear(self) -> None:
        self.url = ""
        self.hide()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.url)


class ServeControl:
    """Connects the action and the status widget to the engine client (GUI thread)."""

    def __init__(self, engine: EngineClient, port: Callable[[], int], notify: Callable[[str], None]) -> None:
        self.engine, self._port, self._notify = engine, port, notify
        self.action = QAction()
        self.action.setCheckable(True)
        self.status = ServeStatus()
        self.update_label()
        self.action.toggled.connect(self._toggled)
        engine.serveStarted.connect(self.status.show_url)
        engine.serveStopped.connect(self._stopped)
        engine.serveFailed.connect(self._failed)
        engine.loaded.connect(lambda _info: self.action.isChecked() and engine.start_serving(self._port()))

    def update_label(self) -> None:
        self.action.setText(f"Serve the loaded model on localhost:{self._port()}")

    def _toggled(self, on: bool) -> None:
        if on:
            self.engine.start_serving(self._port())
        else:
            self.engine.stop_serving()

    def _stopped(self, reason: str) -> None:
        self.status.clear()
        if reason:
            self._notify(reason)

    def _failed(self, reason: str) -> None:
        self.status.clear()
        self.action.blockSignals(True)
        self.action.setChecked(False)
        self.action.blockSignals(False)
        self._notify(reason)
