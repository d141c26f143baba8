"""The model's load options, in words: how much context, how its memory is stored, where there is
a GPU where the model runs (all on the GPU, its experts in system memory, or its first layers on
the GPU), and where there is more than one GPU, how the model is split across them (also as a
choice of where it runs: split across the GPUs by their free memory).

They take effect at the next load (the cache is allocated then); the estimate beside them follows
every change at once, for the model selected in the library, so the user sees what a choice costs
before loading. A view: it shows what it is told and emits what the user picks.
"""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.elided_label import ElidedLabel
from app.library.context_memory import CHOICES, describe
from app.library.parallel_choice import ParallelChoice
from app.library.placement import SPLIT


def _key(key_bits: int, value_bits: int) -> str:
    """An entry's data: a string, since a tuple does not come back from Qt as it went in."""
    return f"{int(key_bits)}/{int(value_bits)}"


# "Where the model runs": (data, label, tooltip); the data as engine.placement_memory names it.
PLACEMENTS = (
    ("gpu", "All on the GPU", "The whole model in GPU memory: the fastest, where it fits."),
    (
        "experts",
        "Experts in system memory",
        "A mixture-of-experts model's experts stay in system memory and run on the CPU; attention "
        "and everything else on the GPU. For a model larger than the GPU.",
    ),
    (
        "layers",
        "First layers on the GPU",
        "The first layers on the GPU, the rest in system memory, run on the CPU (slower the more "
        "layers the CPU runs). For a model larger than the GPU.",
    ),
)
# Offered where there is more than one GPU (set_gpu_count).
SPLIT_PLACEMENT = (
    SPLIT,
    "Split across GPUs automatically",
    "Consecutive layers on each GPU, as many as its free memory holds when the model loads; what "
    "the GPUs cannot hold runs on the CPU. For a model larger than one GPU.",
)


class LoadOptions(QGroupBox):
    contextMemoryChosen = Signal(int, int)  # key bits, value bits (16 = full precision)
    contextLengthChosen = Signal(int)  # tokens
    placementChosen = Signal()  # the user changed where the model runs

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
        # Shown only where there is a GPU (set_gpu_count).
        self.placement = QComboBox()
        self.placement.setAccessibleName("Where the model runs")
        for data, label, tip in PLACEMENTS:
            self.placement.addItem(label, data)
            self.placement.setItemData(self.placement.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        self.placement.setToolTip(
            "Where the model's weights are kept and computed. Applies when a model is loaded."
        )
        self.gpu_layers = QSpinBox()
        self.gpu_layers.setAccessibleName("Layers on the GPU")
        self.gpu_layers.setRange(0, 1024)
        self.gpu_layers.setSuffix(" layers")
        self.gpu_layers.setToolTip("How many of the model's first layers run on the GPU.")
        self.placement_reason = ElidedLabel()
        self.placement_reason.setAccessibleName("Why the model runs there")
        self.placement_reason.setProperty("role", "muted")
        self._placement_label = QLabel("Where the model runs:")
        # Of the GPU the model would run on, and of each GPU (set_gpu_count); 0: unknown. Free
        # memory where the GPU check could read it (gpu_memory_free), else the GPUs' sizes.
        self.gpu_memory_bytes = 0
        self.gpu_memory: tuple[int, ...] = ()
        self.gpu_memory_free = False
        self.estimate = ElidedLabel()
        self.estimate.setAccessibleName("Memory estimate")
        self.estimate.setProperty("role", "muted")
        outer = QVBoxLayout(self)
        row = QHBoxLayout()
        outer.addLayout(row)
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
        placement_row = QHBoxLayout()
        outer.addLayout(placement_row)
        for widget in (self._placement_label, self.placement, self.gpu_layers):
            placement_row.addWidget(widget)
        placement_row.addSpacing(12)
        placement_row.addWidget(self.placement_reason, 1)
        self._set_placement_visible(False)
        self.memory.activated.connect(self._memory_chosen)
        self.placement.activated.connect(self._placement_chosen)
        self.gpu_layers.valueChanged.connect(lambda _n: self.placementChosen.emit())
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

    def _placement_chosen(self, _index: int) -> None:
        self.placement_reason.setText("")  # the user's choice now, not the estimate's
        self._show_layer_count()
        self.placementChosen.emit()

    def _show_layer_count(self) -> None:
        self.gpu_layers.setVisible(self.placement_offered() and self.placement.currentData() == "layers")

    def _set_placement_visible(self, visible: bool) -> None:
        for widget in (self._placement_label, self.placement, self.placement_reason):
            widget.setVisible(visible)
        self._show_layer_count()

    def placement_offered(self) -> bool:
        """Whether the choice of where the model runs is offered (there is a GPU)."""
        return not self.placement.isHidden()

    def set_placement(self, placement: str, gpu_layers: int | None = None, reason: str = "") -> None:
        """Show ``placement`` (one of :data:`PLACEMENTS`' data) with ``gpu_layers`` and the line
        saying why it was chosen (empty: none); emits nothing."""
        index = self.placement.findData(placement)
        if index < 0:
            raise ValueError(f"unknown placement {placement!r}")
        self.placement.setCurrentIndex(index)
        if gpu_layers is not None:
            blocked = self.gpu_layers.blockSignals(True)
            self.gpu_layers.setValue(int(gpu_layers))
            self.gpu_layers.blockSignals(blocked)
        self.placement_reason.setText(reason)
        self.placement_reason.setToolTip(reason)
        self._show_layer_count()

    def set_layer_count(self, layers: int | None) -> None:
        """The selected model's layers: the most the GPU can be given (unknown: no limit)."""
        self.gpu_layers.setMaximum(int(layers) if layers else 1024)

    def current_placement(self) -> tuple[str, int | None]:
        """``(placement, layers on the GPU)`` as chosen ("gpu" where the choice is not offered);
        the layers only for "layers"."""
        if not self.placement_offered():
            return "gpu", None
        placement = self.placement.currentData()
        return placement, self.gpu_layers.value() if placement == "layers" else None

    def set_gpu_count(
        self, count: int, memory_bytes: int = 0, each_gpu: Sequence[int] = (), free: bool = False
    ) -> None:
        """Offer where the model runs where there is a GPU, and splitting a model across GPUs
        where there are ``count`` > 1 of them (from the GPU check; ``memory_bytes``: the first
        GPU's memory, ``each_gpu`` every GPU's, what the automatic choice compares with: free
        memory where ``free``, else their sizes); with fewer, the fields are hidden and a load
        uses one device."""
        self.gpu_memory_bytes = int(memory_bytes) if count else 0
        self.gpu_memory = tuple(int(b) for b in each_gpu) if count else ()
        self.gpu_memory_free = bool(free and count)
        several = count > 1
        self._offer_split(several)
        self._set_placement_visible(count > 0)
        if not count:
            self.set_placement("gpu")
        self.split_gpus.setRange(1, max(1, count))
        for widget in self._parallel_widgets:
            widget.setVisible(several)
        if not several:
            self.split_gpus.setValue(1)
            self.layer_split.clear()

    def _offer_split(self, offered: bool) -> None:
        """Add or remove the automatic split across GPUs as a choice of where the model runs."""
        index = self.placement.findData(SPLIT)
        if offered and index < 0:
            data, label, tip = SPLIT_PLACEMENT
            self.placement.addItem(label, data)
            self.placement.setItemData(self.placement.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        elif not offered and index >= 0:
            if self.placement.currentIndex() == index:
                self.set_placement("gpu")
            self.placement.removeItem(index)

    def parallel_choice(self) -> ParallelChoice:
        """How the next load is to spread the model (one device where the fields are hidden);
        where it runs other than all on the GPU takes the place of a split across GPUs."""
        placement, gpu_layers = self.current_placement()
        if placement == "experts":
            return ParallelChoice(experts_on="cpu")
        if placement == "layers":
            return ParallelChoice(gpu_layers=gpu_layers)
        if placement == SPLIT:
            return ParallelChoice(split_layers="auto")
        if self.split_gpus.maximum() <= 1:
            return ParallelChoice()
        return ParallelChoice(self.split_gpus.value(), self.layer_split.text().strip())
