"""The model's load options, in words: how much context, how its memory is stored and, where
there is more than one GPU, how the model is split across them.

They take effect at the next load (the cache is allocated then); the estimate beside them follows
every change at once, for the model selected in the library, so the user sees what a choice costs
before loading. A view: it shows what it is told and emits what the user picks.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QSpinBox, QWidget

from app.elided_label import ElidedLabel
from app.library.context_memory import CHOICES, describe
from app.library.parallel_choice import ParallelChoice


def _key(key_bits: int, value_bits: int) -> str:
    """An entry's data: a string, since a tuple does not come back from Qt as it went in."""
    return f"{int(key_bits)}/{int(value_bits)}"


class LoadOptions(QGroupBox):
    contextMemoryChosen = Signal(int, int)  # key bits, value bits (16 = full precision)
    contextLengthChosen = Signal(int)  # tokens

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Load options", parent)
        self.setAccessibleName("Load options")
        self.memory = QComboBox()
        self.memory.setAccessibleName("Context memory")
        self.memory.setToolTip(
            "How the conversation the model reads (its KV cache) is stored in memory. "
            "Applies when a model is loaded."
        )
        for choice in CHOICES:
            self.memory.addItem(choice.label, _key(choice.key_bits, choice.value_bits))
            self.memory.setItemData(self.memory.count() - 1, choice.description, Qt.ItemDataRole.ToolTipRole)
        self.context = QSpinBox()
        self.context.setAccessibleName("Context length")
        self.context.setRange(256, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setGroupSeparatorShown(True)
        self.context.setSuffix(" tokens")
        self.context.setToolTip(
            "The most a conversation can hold (capped at the model's own limit). More context "
            "needs more memory. Applies when a model is loaded."
        )
        # Shown only where there is more than one GPU (set_gpu_count).
        self.split_gpus = QSpinBox()
        self.split_gpus.setAccessibleName("Split across GPUs")
        self.split_gpus.setRange(1, 1)
        self.split_gpus.setToolTip(
            "Run the model on this many GPUs at once (tensor parallel): each holds a part of every "
            "layer. Applies when a model is loaded."
        )
        self.layer_split = QLineEdit()
        self.layer_split.setAccessibleName("Layer split")
        self.layer_split.setPlaceholderText("e.g. 20,12")
        self.layer_split.setToolTip(
            "Or put consecutive layers on each GPU: how many on GPU 0, GPU 1, ... (they must add "
            "up to the model's layers). Leave empty for none. Applies when a model is loaded."
        )
        self._parallel_widgets = [
            QLabel("Split across GPUs:"),
            self.split_gpus,
            QLabel("Layer split:"),
            self.layer_split,
        ]
        self.estimate = ElidedLabel()
        self.estimate.setAccessibleName("Memory estimate")
        self.estimate.setProperty("role", "muted")
        row = QHBoxLayout(self)
        row.addWidget(QLabel("Context memory:"))
        row.addWidget(self.memory)
        row.addSpacing(12)
        row.addWidget(QLabel("Context length:"))
        row.addWidget(self.context)
        for widget in self._parallel_widgets:
            row.addSpacing(12 if isinstance(widget, QLabel) else 0)
            row.addWidget(widget)
            widget.setVisible(False)
        row.addSpacing(12)
        row.addWidget(self.estimate, 1)
        self.memory.activated.connect(self._memory_chosen)
        self.context.editingFinished.connect(lambda: self.contextLengthChosen.emit(self.context.value()))

    def _memory_chosen(self, index: int) -> None:
        key_bits, value_bits = self.memory.itemData(index).split("/")
        self.contextMemoryChosen.emit(int(key_bits), int(value_bits))

    def cache_bits(self) -> tuple[int, int]:
        key_bits, value_bits = self.memory.currentData().split("/")
        return int(key_bits), int(value_bits)

    def set_cache_bits(self, key_bits: int, value_bits: int) -> None:
        """Show the widths in effect (from the settings); emits nothing. Widths that are none of
        the three choices (set by an older version) get an entry of their own."""
        index = self.memory.findData(_key(key_bits, value_bits))
        if index < 0:
            self.memory.addItem(describe(key_bits, value_bits).capitalize(), _key(key_bits, value_bits))
            index = self.memory.count() - 1
        self.memory.setCurrentIndex(index)

    def set_context_length(self, tokens: int) -> None:
        blocked = self.context.blockSignals(True)
        self.context.setValue(int(tokens))
        self.context.blockSignals(blocked)

    def set_estimate(self, text: str, tooltip: str = "") -> None:
        self.estimate.setText(text)
        if tooltip:
            self.estimate.setToolTip(tooltip)

    def set_gpu_count(self, count: int) -> None:
        """Offer splitting a model across GPUs where there are ``count`` > 1 of them (from the
        GPU check); with fewer, the fields are hidden and a load uses one device."""
        several = count > 1
        self.split_gpus.setRange(1, max(1, count))
        for widget in self._parallel_widgets:
            widget.setVisible(several)
        if not several:
            self.split_gpus.setValue(1)
            self.layer_split.clear()

    def parallel_choice(self) -> ParallelChoice:
        """How the next load is to spread the model (one device where the fields are hidden)."""
        if self.split_gpus.maximum() <= 1:
            return ParallelChoice()
        return ParallelChoice(self.split_gpus.value(), self.layer_split.text().strip())
