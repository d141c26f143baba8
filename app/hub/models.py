"""Item models of the Hub browser: search hits and the files of a model page (GUI thread only)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, Qt

from app.table_model import ColumnTableModel
from engine.hub.client import ModelSummary, RepoFile
from engine.units import format_bytes, format_count

SUMMARY_ROLE = Qt.ItemDataRole.UserRole + 1


class _Table(ColumnTableModel):
    def set_rows(self, rows: list[Any]) -> None:
        self.beginResetModel()
        self._rows = list(rows)
        self.endResetModel()

    def row_object(self, row: int) -> Any:
        return self._rows[row]


class SearchResultsModel(_Table):
    COLUMNS = ("Model", "Params", "Downloads", "Likes", "Updated", "Notes")

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid():
            return None
        hit: ModelSummary = self._rows[index.row()]
        if role == SUMMARY_ROLE:
            return hit
        if role == Qt.ItemDataRole.TextAlignmentRole and 1 <= index.column() <= 3:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        col = self.COLUMNS[index.column()]
        if col == "Model":
            return hit.repo_id
        if col == "Params":
            return format_count(hit.params, unknown="")
        if col == "Downloads":
            return f"{hit.downloads:,}"
        if col == "Likes":
            return f"{hit.likes:,}"
        if col == "Updated":
            return hit.last_modified.date().isoformat() if hit.last_modified else ""
        notes = [
            n
            for n, on in (("EXL3", hit.exl3), ("supported", hit.supported), ("gated", bool(hit.gated)))
            if on
        ]
        return ", ".join(notes)


class FilesModel(_Table):
    COLUMNS = ("File", "Size", "Hash")

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid():
            return None
        f: RepoFile = self._rows[index.row()]
        if role == Qt.ItemDataRole.ToolTipRole and index.column() == 2:
            return f.sha256 or f.blob_id
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if index.column() == 0:
            return f.path
        if index.column() == 1:
            return format_bytes(f.size)
        return f"sha256 {f.sha256[:12]}…" if f.sha256 else (f"git {f.blob_id[:12]}…" if f.blob_id else "")
