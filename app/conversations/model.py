"""Conversations as a Qt list model (GUI thread only), filled from the store or a search."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QObject, QPersistentModelIndex, Qt

from app.gui_thread import require_gui_thread
from app.store import Store

ID_ROLE = Qt.ItemDataRole.UserRole + 1


@dataclass
class ConversationRow:
    id: int
    title: str
    updated_at: float
    snippet: str = ""


def _age(timestamp: float, now: float) -> str:
    seconds = max(0, now - timestamp)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(timestamp))


class ConversationListModel(QAbstractListModel):
    def __init__(self, store: Store, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.query = ""
        self._rows: list[ConversationRow] = []

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid():
            return None
        row = self._rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return row.title
        if role == Qt.ItemDataRole.ToolTipRole:
            return row.snippet or f"{row.title}\n{_age(row.updated_at, time.time())}"
        if role == Qt.ItemDataRole.AccessibleDescriptionRole:
            return row.snippet
        if role == ID_ROLE:
            return row.id
        return None

    def ids(self) -> list[int]:
        return [r.id for r in self._rows]

    def row_of(self, conversation_id: int) -> int:
        ids = self.ids()
        return ids.index(conversation_id) if conversation_id in ids else -1

    def set_query(self, query: str) -> None:
        self.query = query.strip()
        self.refresh()

    def refresh(self) -> None:
        """Re-read from the store: all conversations, or the matches of the current search."""
        require_gui_thread("ConversationListModel")
        if self.query:
            rows = []
            for hit in self.store.search(self.query):
                conv = self.store.conversation(hit.conversation_id)
                rows.append(ConversationRow(conv.id, conv.title, conv.updated_at, hit.snippet))
        else:
            rows = [ConversationRow(c.id, c.title, c.updated_at) for c in self.store.conversations()]
        self.beginResetModel()
        self._rows = rows
        self.endResetModel()
