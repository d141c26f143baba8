"""The model bar: which model is loaded, load/unload, load progress, memory used."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget

from app.library.model import PATH_ROLE, LibraryModel
from engine.inspect import format_bytes


class ModelBar(QWidget):
    loadRequested = Signal(str)
    unloadRequested = Signal()

    def __init__(self, library: LibraryModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Model bar")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(6, 2, 6, 2)
        self.status = QLabel("No model loaded")
        self.status.setAccessibleName("Loaded model")
        self.status.setTextFormat(Qt.TextFormat.RichText)
        self.picker = QComboBox()
        self.picker.setAccessibleName("Model to load")
        self.picker.setModel(library)  # column 0: names; PATH_ROLE gives the folder
        self.picker.setMinimumContentsLength(18)
        self.picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.load_button = QPushButton("Load")
        self.load_button.setAccessibleName("Load model")
        self.unload_button = QPushButton("Unload")
        self.unload_button.setAccessibleName("Unload model")
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Model loading progress")
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(220)
        self.progress.hide()
        layout.addWidget(self.status, 1)
        layout.addWidget(self.progress)
        layout.addWidget(self.picker)
        layout.addWidget(self.load_button)
        layout.addWidget(self.unload_button)
        self.unload_button.setEnabled(False)
        self.load_button.clicked.connect(self._load_clicked)
        self.unload_button.clicked.connect(self.unloadRequested)
        library.modelReset.connect(lambda: self.load_button.setEnabled(self.picker.count() > 0))
        self.load_button.setEnabled(self.picker.count() > 0)

    def _load_clicked(self) -> None:
        path = self.picker.currentData(PATH_ROLE)
        if path:
            self.loadRequested.emit(path)

    def set_progress(self, fraction: float, message: str) -> None:
        self.progress.show()
        self.progress.setValue(int(max(0.0, min(1.0, fraction)) * 1000))
        self.progress.setFormat(f"{message} %p%")
        self.load_button.setEnabled(False)

    def set_loading(self, name: str) -> None:
        self.status.setText(f"Loading <b>{html.escape(name)}</b>…")
        self.set_progress(0.0, "Loading")

    def set_loaded(self, info: dict) -> None:
        self.progress.hide()
        memory = format_bytes(int(info.get("memory_bytes", 0)))
        self.status.setText(
            f"<b>{html.escape(str(info.get('name', '?')))}</b> · {html.escape(str(info.get('device', '?')))}"
            f" · {memory} · context {info.get('context_length', '?')}"
        )
        self.load_button.setEnabled(True)
        self.unload_button.setEnabled(True)

    def set_unloaded(self, message: str = "No model loaded") -> None:
        self.progress.hide()
        self.status.setText(html.escape(message))
        self.load_button.setEnabled(self.picker.count() > 0)
        self.unload_button.setEnabled(False)

    def select_path(self, path: str) -> None:
        index = self.picker.findData(path, PATH_ROLE)
        if index >= 0:
            self.picker.setCurrentIndex(index)
