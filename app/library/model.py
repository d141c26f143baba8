"""The library as a Qt table model: one row per model folder found (GUI thread only).

The Memory column estimates the load the app would make: at the context the model would be
loaded with (``app.library.load_context``), on the likely device, with the chosen cache widths.
On a GPU too small for a model it shows the placement the app would choose
(``app.library.placement``): the GPU and system-memory parts of experts in system memory or of the
first layers on the GPU, or the layers split across the GPUs, with the reason as its tooltip.
What a folder's files do not say is shown as "—", not as a wall of question marks."""

from __future__ import annotations

from typing import Any, NamedTuple

from PySide6.QtCore import QModelIndex, QObject, QPersistentModelIndex, Qt

from app.gui_thread import require_gui_thread
from app.library.load_context import DEFAULT_CONTEXT, load_context
from app.library.placement import SPLIT, PlacementAdvice, advise, estimate_split, split_text
from app.table_model import ColumnTableModel
from engine.inspect import MemoryVerdict, ModelInfo, memory_verdict
from engine.units import format_bytes, format_count

INFO_ROLE = Qt.ItemDataRole.UserRole + 1
PATH_ROLE = Qt.ItemDataRole.UserRole + 2

COLUMNS = ("Name", "Architecture", "Parameters", "Quantization", "Size", "Memory", "Status")
UNKNOWN = "—"


class _Row(NamedTuple):
    """A model folder and its estimate under the current assumptions, computed when they change
    (not on every paint): the Memory column's text and tooltip (the placement's reason, or "")."""

    info: ModelInfo
    verdict: MemoryVerdict
    memory: str
    memory_tip: str


class LibraryModel(ColumnTableModel):
    COLUMNS = COLUMNS

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._rows: list[_Row] = []
        self.context_limit = DEFAULT_CONTEXT  # the user's context length (engine.context_length)
        self.device = "cpu"  # what the estimate assumes (engine.inspect.likely_device)
        self.cache_bits: tuple[int, int] = (16, 16)  # KV cache key/value bits the estimate assumes
        # Each GPU's usable bytes (free where the GPU check read it: ``gpu_free``), for the placement
        # a model too big for the first would get; empty: no GPU known.
        self.gpu_memory: list[int] = []
        self.gpu_free = False

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid():
            return None
        info, _verdict, memory, memory_tip = self._rows[index.row()]
        if role == INFO_ROLE:
            return info
        if role == PATH_ROLE:
            return str(info.path)
        column = COLUMNS[index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:
            if column == "Memory" and memory_tip:
                return memory_tip
            return "\n".join(info.problems) if info.problems else str(info.path)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if column == "Name":
            return info.name
        if column == "Architecture":
            return info.architecture or UNKNOWN
        if column == "Parameters":
            return format_count(info.parameter_count, unknown=UNKNOWN)
        if column == "Quantization":
            return info.quantization or UNKNOWN
        if column == "Size":
            return format_bytes(info.size_bytes)
        if column == "Memory":
            return memory
        return "ready" if info.ok else "cannot load"  # the reasons: tooltip and details panel

    def _row(self, info: ModelInfo) -> _Row:
        verdict = self._verdict(info)
        if not info.ok:
            return _Row(info, verdict, UNKNOWN, "")
        advice = self.placement(info)
        tip = advice.reason if advice is not None else ""
        if advice is None or advice.placement == "gpu":
            return _Row(info, verdict, f"{format_bytes(verdict.needed_bytes)} ({verdict.verdict})", tip)
        if advice.placement == SPLIT:
            text = f"{format_bytes(verdict.needed_bytes)} (across {len(self.gpu_memory)} GPUs)"
            return _Row(info, verdict, text, tip)
        split = estimate_split(
            info, self.context_for(info), self.cache_bits, advice.placement, advice.gpu_layers
        )
        where = (
            "experts in system memory"
            if advice.placement == "experts"
            else f"{advice.gpu_layers} layers on the GPU"
        )
        return _Row(info, verdict, f"{split_text(split)} ({where})", tip)

    def placement(self, info: ModelInfo) -> PlacementAdvice | None:
        """Where the app would run ``info``'s model on the known GPUs (None: no GPU is known or
        the estimate is not for one)."""
        if self.device != "cuda" or not self.gpu_memory:
            return None
        first, more = self.gpu_memory[0], self.gpu_memory[1:]
        return advise(info, self.context_for(info), self.cache_bits, first, self.gpu_free, more)

    def set_gpus(self, memory: list[int], free: bool) -> None:
        """The GPUs the estimates place models on (``memory``: each one's usable bytes, free ones
        where ``free``), then the Memory column again."""
        self.gpu_memory, self.gpu_free = list(memory), free
        self.refresh_estimates()

    def set_models(self, infos: list[ModelInfo]) -> None:
        require_gui_thread("LibraryModel")
        self.beginResetModel()
        self._rows = [self._row(info) for info in infos]
        self.endResetModel()

    def refresh_estimates(self) -> None:
        """Recompute the memory column for the current context, device and cache bits (no rescan:
        the model folders have not changed, only what the estimate assumes)."""
        require_gui_thread("LibraryModel")
        self._rows = [self._row(row.info) for row in self._rows]
        if self._rows:
            column = COLUMNS.index("Memory")
            self.dataChanged.emit(self.index(0, column), self.index(len(self._rows) - 1, column))

    def context_for(self, info: ModelInfo) -> int:
        """Tokens of context ``info``'s model would be loaded with."""
        return load_context(info.context_length, self.context_limit)

    def _verdict(self, info: ModelInfo) -> MemoryVerdict:
        return memory_verdict(info, self.context_for(info), self.device, self.cache_bits)

    def infos(self) -> list[ModelInfo]:
        return [row.info for row in self._rows]

    def verdict(self, row: int) -> MemoryVerdict:
        return self._rows[row].verdict

    def row_of(self, path: str) -> int:
        for row, entry in enumerate(self._rows):
            if str(entry.info.path) == str(path):
                return row
        return -1
