"""The library's Memory column on a GPU too small for a model: the placement the app would choose
(experts in system memory, first layers on the GPU, split across GPUs) with its GPU and
system-memory parts, and the reason as the tooltip; without a known GPU, the one figure."""

from __future__ import annotations

from PySide6.QtCore import Qt
from sparse_models import GIB, big_dense, big_moe

from app.library.model import COLUMNS, LibraryModel
from engine.inspect import inspect_model

MEMORY = COLUMNS.index("Memory")


def _memory(model: LibraryModel, row: int, role=Qt.ItemDataRole.DisplayRole) -> str:
    return model.data(model.index(row, MEMORY), role)


def test_the_memory_column_shows_the_split_the_app_would_choose(qapp, tmp_path) -> None:
    model = LibraryModel()
    model.device = "cuda"
    model.set_models([inspect_model(big_moe(tmp_path)), inspect_model(big_dense(tmp_path))])
    plain = [_memory(model, 0), _memory(model, 1)]
    assert all("system memory" not in text for text in plain)  # no GPU known yet: one figure

    model.set_gpus([2 * GIB], free=True)
    moe, dense = _memory(model, 0), _memory(model, 1)
    assert moe.startswith("GPU ≈ ") and moe.endswith("(experts in system memory)"), moe
    assert dense.startswith("GPU ≈ ") and "layers on the GPU)" in dense, dense
    assert "which has 2.0 GiB free: its first 1 of 4 layers" in _memory(model, 1, Qt.ItemDataRole.ToolTipRole)

    model.set_gpus([4 * GIB, 4 * GIB], free=True)  # the dense model fits the two GPUs together
    assert _memory(model, 1).endswith("(across 2 GPUs)")

    model.set_gpus([80 * GIB], free=True)  # fits the GPU whole: the one figure again
    assert _memory(model, 0) == plain[0] and _memory(model, 1) == plain[1]
