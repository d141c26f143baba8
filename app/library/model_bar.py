"""The model bar: which model is loaded, load/unload, load progress, memory used, and the KV
cache's bit widths with the memory estimate they give for the model picked.

The cache widths take effect when a model is loaded (the cache is allocated then); the estimate
next to them follows every change at once, so the user sees what a width buys before loading.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget

from app.library.model import INFO_ROLE, PATH_ROLE, LibraryModel
from engine.api import ModelInfo
from engine.inspect import CACHE_BITS_CHOICES
from engine.units import format_bytes


class ModelBar(QWidget):
    loadRequested = Signal(str)
    unloadRequested = Signal()
    cacheBitsChosen = Signal(int, int)  # key bits, value bits (16 = unquantized)

    def __init__(self, library: LibraryModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Model bar")
        self.library = library
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
        self.key_bits = self._bits_combo("Key cache bits", "keys")
        self.value_bits = self._bits_combo("Value cache bits", "values")
        self.estimate = QLabel()
        self.estimate.setAccessibleName("Memory estimate")
        self.estimate.setMinimumWidth(150)
        layout.addWidget(self.status, 1)
        layout.addWidget(self.progress)
        layout.addWidget(QLabel("KV cache K"))
        layout.addWidget(self.key_bits)
        layout.addWidget(QLabel("V"))
        layout.addWidget(self.value_bits)
        layout.addWidget(self.estimate)
        layout.addWidget(self.picker)
        layout.addWidget(self.load_button)
        layout.addWidget(self.unload_button)
        self.unload_button.setEnabled(False)
        self.load_button.clicked.connect(self._load_clicked)
        self.unload_button.clicked.connect(self.unloadRequested)
        library.modelReset.connect(lambda: self.load_button.setEnabled(self.picker.count() > 0))
        self.load_button.setEnabled(self.picker.count() > 0)
        for combo in (self.key_bits, self.value_bits):
            combo.activated.connect(self._bits_chosen)
        self.picker.currentIndexChanged.connect(self.update_estimate)
        library.modelReset.connect(self.update_estimate)
        library.dataChanged.connect(self.update_estimate)
        self.update_estimate()

    def _bits_combo(self, name: str, what: str) -> QComboBox:
        combo = QComboBox()
        combo.setAccessibleName(name)
        combo.setToolTip(
            f"Bits per number for the cached {what}. 16 is exact; fewer hold more context in the "
            "same memory at a small cost in accuracy. Applies when a model is loaded."
        )
        for bits in CACHE_BITS_CHOICES:
            combo.addItem("16 (full)" if bits >= 16 else str(bits), bits)
        return combo

    def _bits_chosen(self) -> None:
        self.cacheBitsChosen.emit(int(self.key_bits.currentData()), int(self.value_bits.currentData()))

    def cache_bits(self) -> tuple[int, int]:
        return int(self.key_bits.currentData()), int(self.value_bits.currentData())

    def set_cache_bits(self, key_bits: int, value_bits: int) -> None:
        """Show the widths in effect (from the settings); emits nothing."""
        for combo, bits in ((self.key_bits, key_bits), (self.value_bits, value_bits)):
            index = combo.findData(int(bits))
            if index >= 0:
                combo.setCurrentIndex(index)

    def update_estimate(self, *_args) -> None:
        """The picked model's memory estimate, as the library computed it for the current widths."""
        row = self.picker.currentIndex()
        if row < 0 or row >= self.library.rowCount():
            self.estimate.setText("")
            self.estimate.setToolTip("")
            return
        info = self.library.index(row, 0).data(INFO_ROLE)
        if info is None or not info.ok:
            self.estimate.setText("")
            self.estimate.setToolTip("")
            return
        verdict = self.library.verdict(row)
        k, v = self.library.cache_bits
        cache = info.kv_cache_bytes(
            self.library.context_length, 4 if self.library.device == "cpu" else 2, (k, v)
        )
        self.estimate.setText(f"≈ {format_bytes(verdict.needed_bytes)} ({verdict.verdict})")
        self.estimate.setToolTip(
            f"Estimated memory for {info.name} on {self.library.device} with "
            f"{self.library.context_length} tokens of context: {format_bytes(verdict.needed_bytes)}, "
            f"of which the KV cache ({k}/{v} bits) is {format_bytes(cache)}."
        )

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

    def set_loaded(self, info: ModelInfo) -> None:
        self.progress.hide()
        k, v = info.cache_bits
        cache = f" · KV cache {k}/{v} bit" if (k, v) != (16, 16) else ""
        images = " · sees images" if info.sees_images else ""
        self.status.setText(
            f"<b>{html.escape(info.name)}</b> · {html.escape(info.device)}"
            f" · {format_bytes(info.memory_bytes)} · context {info.context_length}{cache}{images}"
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
