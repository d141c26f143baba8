"""Conversations as a Qt list model (GUI thread only), filled from the store or a search.

Each row has its title (display), when it was last active (``DATE_ROLE``: "just now", "5 min
ago", the time today, "yesterday", a weekday this week, else a date) and, while searching, the
matching words of its best message (``SNIPPET_ROLE``, the store's match marks removed;
``TERMS_ROLE`` are the query's words, for the delegate to highlight)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QObject, QPersistentModelIndex, Qt

from app.conversations.highlight import query_terms, strip_snippet_marks
from app.gui_thread import require_gui_thread
from app.store import Store

ID_ROLE = Qt.ItemDataRole.UserRole + 1
DATE_ROLE = Qt.ItemDataRole.UserRole + 2
SNIPPET_ROLE = Qt.ItemDataRole.UserRole + 3
TERMS_ROLE = Qt.ItemDataRole.UserRole + 4


@dataclass
class ConversationRow:
    id: int
    title: str
    updated_at: float
    snippet: str = ""


def _age(timestamp: float, now: float) -> str:
    """Short and relative while recent, then the weekday, then the date."""
    seconds = max(0, now - timestamp)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    then, today = datetime.fromtimestamp(timestamp), datetime.fromtimestamp(now)
    days = (today.date() - then.date()).days
    if days <= 0:
        return then.strftime("%H:%M")
    if days == 1:
        return "yesterday"
    if days < 7:
        return then.strftime("%A")
    if then.year == today.year:
        return f"{then.day} {then.strftime('%b')}"
    return then.strftime("%Y-%m-%d")


class ConversationListModel(QAbstractListModel):
    def __init__(self, store: Store, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.query = ""
        self._terms: list[str] = []
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
        if role == DATE_ROLE:
            return _age(row.updated_at, time.time())
        if role == SNIPPET_ROLE:
            return row.snippet
        if role == TERMS_ROLE:
            return self._terms
        if role == Qt.ItemDataRole.ToolTipRole:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.updated_at))
            return f"{row.title}\n{when}" + (f"\n…{row.snippet}…" if row.snippet else "")
        if role == Qt.ItemDataRole.AccessibleDescriptionRole:
            return row.snippet or _age(row.updated_at, time.time())
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
        self._terms = query_terms(self.query)
        self.refresh()

    def terms(self) -> list[str]:
        """The words of the current search ([] when not searching)."""
        return list(self._terms)

    def refresh(self) -> None:
        """Re-read from the store: all conversations, or the matches of the current search."""
        require_gui_thread("ConversationListModel")
        if self.query:
            rows = []
            for hit in self.store.search(self.query):
                conv = self.store.conversation(hit.conversation_id)
                snippet = strip_snippet_marks(hit.snippet or "", self._terms)
                rows.append(ConversationRow(conv.id, conv.title, conv.updated_at, snippet))
        else:
            rows = [ConversationRow(c.id, c.title, c.updated_at) for c in self.store.conversations()]
        self.beginResetModel()
        self._rows = rows
        self.endResetModel()
