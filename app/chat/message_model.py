"""The visible branch of a conversation as a Qt list model.

Rows are the messages on the path from the root to the current leaf. The model is mutated only
on the GUI thread (by ``ChatController``); views only read it and react to its signals. A
streaming reply is one row whose ``content`` grows: ``append_text`` emits ``dataChanged`` for that
row alone, which is what lets the view re-render only the streaming message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QObject, QPersistentModelIndex, Qt

from app.gui_thread import require_gui_thread


@dataclass
class MessageItem:
    id: int
    role: str
    content: str
    complete: bool = True
    sibling_index: int = 0  # position among alternatives (regenerations / edits)
    sibling_count: int = 1
    stats: dict[str, Any] = field(default_factory=dict)
    streaming: bool = False
    error: str = ""
    images: list[str] = field(default_factory=list)  # sha256 of attached images (the store has them)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # see app.store.Message.tool_calls
    created_at: float = 0.0  # seconds since the epoch; 0 for a message not stored yet


class Roles(IntEnum):
    ITEM = Qt.ItemDataRole.UserRole + 1
    ID = Qt.ItemDataRole.UserRole + 2
    ROLE = Qt.ItemDataRole.UserRole + 3
    STREAMING = Qt.ItemDataRole.UserRole + 4


class ChatMessageModel(QAbstractListModel):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._items: list[MessageItem] = []

    # -- read side (views) ---------------------------------------------------------------------

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._items)

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._items):
            return None
        item = self._items[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return item.content
        if role == Roles.ITEM:
            return item
        if role == Roles.ID:
            return item.id
        if role == Roles.ROLE:
            return item.role
        if role == Roles.STREAMING:
            return item.streaming
        return None

    def item(self, row: int) -> MessageItem:
        return self._items[row]

    def items(self) -> list[MessageItem]:
        return list(self._items)

    def row_of(self, message_id: int) -> int:
        for row, item in enumerate(self._items):
            if item.id == message_id:
                return row
        return -1

    # -- write side (controller, GUI thread only) ------------------------------------------------

    def set_items(self, items: list[MessageItem]) -> None:
        require_gui_thread("ChatMessageModel")
        self.beginResetModel()
        self._items = list(items)
        self.endResetModel()

    def append(self, item: MessageItem) -> int:
        require_gui_thread("ChatMessageModel")
        row = len(self._items)
        self.beginInsertRows(QModelIndex(), row, row)
        self._items.append(item)
        self.endInsertRows()
        return row

    def update(self, row: int, **changes: Any) -> None:
        require_gui_thread("ChatMessageModel")
        self._items[row] = replace(self._items[row], **changes)
        index = self.index(row)
        self.dataChanged.emit(index, index)

    def append_text(self, row: int, text: str) -> None:
        require_gui_thread("ChatMessageModel")
        item = self._items[row]
        item.content += text
        index = self.index(row)
        self.dataChanged.emit(index, index, [Qt.ItemDataRole.DisplayRole])
