"""The model's load options, in words: how much context, and how its memory is stored.

Both take effect at the next load (the cache is allocated then); the estimate beside them follows
every change at once, for the model selected in the library, so the user sees what a choice costs
before loading. A view: it shows what it is told and emits what the user picks.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QGroupBox, QHBoxLayout, QLabel, QSpinBox, QWidget

from app.elided_label import ElidedLabel
from app.library.context_memory import CHOICES, describe


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
        self.estimate = ElidedLabel()
        self.estimate.setAccessibleName("Memory estimate")
        self.estimate.setProperty("role", "muted")
        row = QHBoxLayout(self)
        row.addWidget(QLabel("Context memory:"))
        row.addWidget(self.memory)
        row.addSpacing(12)
        row.addWidget(QLabel("Context length:"))
        row.addWidget(self.context)
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
