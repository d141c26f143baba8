"""The model bar at the top of the chat: the model picker, whether the model picked fits (its
quantization, the memory it needs, the verdict: ``app.library.fit``), load/unload, load progress,
and which model is loaded.

How a model is loaded (context length, context memory) is chosen in the library's load options,
in words; the bar only says what is in effect. Its texts are elided to the room they get (the
whole text in the tooltip), so a long model name or progress message never clips or widens the
toolbar; the progress bar shows only its percentage, the message goes to the status text.
"""

from __future__ import annotations

from PySide6.QtCore import QAbstractItemModel, QConcatenateTablesProxyModel, Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget

from app.elided_label import ElidedLabel
from app.library.context_memory import describe
from app.library.fit import fit_text
from app.library.model import INFO_ROLE, PATH_ROLE, LibraryModel
from app.theme import SPACE_S
from engine.api import ModelInfo
from engine.units import format_bytes


class ModelBar(QWidget):
    loadRequested = Signal(str)
    unloadRequested = Signal()

    def __init__(self, library: LibraryModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Model bar")
        self.library = library
        self._loading_name = ""
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(SPACE_S)
        self.status = ElidedLabel("No model loaded")
        self.status.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.status.setProperty("role", "muted")
        self.status.setAccessibleName("Loaded model")
        self.picker = QComboBox()
        self.picker.setAccessibleName("Model to load")
        self.picker.setModel(library)  # column 0: names; PATH_ROLE gives the folder
        self.picker.setPlaceholderText("No models yet")
        self.picker.setMinimumContentsLength(22)
        self.picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.load_button = QPushButton("Load")
        self.load_button.setAccessibleName("Load model")
        self.unload_button = QPushButton("Unload")
        self.unload_button.setAccessibleName("Unload model")
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Model loading progress")
        self.progress.setRange(0, 1000)
        self.progress.setFormat("%p%")
        self.progress.setFixedWidth(120)
        self.progress.hide()
        self.estimate = QLabel()
        self.estimate.setAccessibleName("Memory estimate")
        self.estimate.setProperty("role", "muted")
        layout.addWidget(self.picker)
        layout.addWidget(self.estimate)
        layout.addWidget(self.load_button)
        layout.addWidget(self.unload_button)
        layout.addWidget(self.progress)
        layout.addWidget(self.status, 1)
        self.unload_button.setEnabled(False)
        self.load_button.clicked.connect(self._load_clicked)
        self.unload_button.clicked.connect(self.unloadRequested)
        library.modelReset.connect(lambda: self.load_button.setEnabled(self.picker.count() > 0))
        self.load_button.setEnabled(self.picker.count() > 0)
        self.picker.currentIndexChanged.connect(self.update_estimate)
        library.modelReset.connect(self.update_estimate)
        library.dataChanged.connect(self.update_estimate)
        self.update_estimate()

    def add_source(self, rows: QAbstractItemModel) -> None:
        """Offer ``rows`` (e.g. remote engines' models, ``PATH_ROLE`` their references) after the
        library's models; the memory estimate stays the library's rows' own."""
        if not isinstance(self.picker.model(), QConcatenateTablesProxyModel):
            combined = QConcatenateTablesProxyModel(self)
            combined.addSourceModel(self.library)
            self.picker.setModel(combined)
        self.picker.model().addSourceModel(rows)
        for signal in (rows.rowsInserted, rows.rowsRemoved, rows.modelReset):
            signal.connect(lambda *_: self.load_button.setEnabled(self.picker.count() > 0))

    def update_estimate(self, *_args) -> None:
        """The picked model's memory estimate, as the library computed it for the load options."""
        row = self.picker.currentIndex()
        info = self.library.index(row, 0).data(INFO_ROLE) if 0 <= row < self.library.rowCount() else None
        if info is None or not info.ok:
            self.estimate.setText("")
            self.estimate.setToolTip("")
            return
        verdict = self.library.verdict(row)
        k, v = self.library.cache_bits
        context = self.library.context_for(info)
        cache = info.kv_cache_bytes(context, 4 if self.library.device == "cpu" else 2, (k, v))
        self.estimate.setText(fit_text(info, verdict))
        self.estimate.setToolTip(
            f"Estimated memory for {info.name} on {self.library.device} with {context:,} tokens of "
            f"context: {format_bytes(verdict.needed_bytes)}, of which the context memory "
            f"({describe(k, v).lower()}) is {format_bytes(cache)}. Change them in Library › Load options."
        )

    def _load_clicked(self) -> None:
        path = self.picker.currentData(PATH_ROLE)
        if path:
            self.loadRequested.emit(path)

    def set_progress(self, fraction: float, message: str) -> None:
        self.progress.show()
        self.progress.setValue(int(max(0.0, min(1.0, fraction)) * 1000))
        name = f"{self._loading_name}: " if self._loading_name else ""
        self.status.setText(f"{name}{message}…" if message else self.status.text())
        self.load_button.setEnabled(False)

    def set_loading(self, name: str) -> None:
        self._loading_name = f"Loading {name}"
        self.set_progress(0.0, "starting")

    def set_loaded(self, info: ModelInfo) -> None:
        self._loading_name = ""
        self.progress.hide()
        parts = [info.name, info.device]
        if info.memory_bytes:  # a remote model's memory is not ours to know
            parts.append(format_bytes(info.memory_bytes))
        if info.context_length:
            parts.append(f"context {info.context_length:,}")
        if info.memory_bytes:
            parts.append(f"context memory {describe(*info.cache_bits).lower()}")
        if info.sees_images:
            parts.append("sees images")
        if not info.chat_template:
            parts.append("plain-text completion")
        self.status.setText(" · ".join(parts))
        self.load_button.setEnabled(True)
        self.unload_button.setEnabled(True)

    def set_unloaded(self, message: str = "No model loaded") -> None:
        self._loading_name = ""
        self.progress.hide()
        self.status.setText(message)
        self.load_button.setEnabled(self.picker.count() > 0)
        self.unload_button.setEnabled(False)

    def select_path(self, path: str) -> None:
        index = self.picker.findData(path, PATH_ROLE)
        if index >= 0:
            self.picker.setCurrentIndex(index)
