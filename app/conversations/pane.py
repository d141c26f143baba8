"""The conversation list pane: search box, list (titles elided, dates, highlighted matches while
searching), New / Rename / Delete; with no conversations (or no matches) it says so and how to
start one."""

from __future__ import annotations

from PySide6.QtCore import QItemSelectionModel, QModelIndex, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListView,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.conversations.delegate import ConversationDelegate
from app.conversations.model import ID_ROLE, ConversationListModel
from app.empty_state import EmptyStack, EmptyState
from app.theme import SPACE_S, font_for

# The rename dialog is wide enough for a long title (QInputDialog's default fits ~20 characters).
RENAME_DIALOG_WIDTH = 480


class ConversationPane(QWidget):
    """A view: shows the list model and emits what the user asked for."""

    conversationSelected = Signal(int)
    newRequested = Signal()
    renameRequested = Signal(int, str)
    deleteRequested = Signal(int)

    def __init__(self, model: ConversationListModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setAccessibleName("Conversations")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(SPACE_S, SPACE_S, SPACE_S, SPACE_S)
        layout.setSpacing(SPACE_S)

        self.search = QLineEdit()
        self.search.setAccessibleName("Search conversations")
        self.search.setPlaceholderText("Search conversations (Ctrl+F)")
        self.search.setClearButtonEnabled(True)
        layout.addWidget(self.search)

        self.list = QListView()
        self.list.setAccessibleName("Conversation list")
        self.list.setModel(model)
        self.list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        # Titles are elided to the list's width (with the date beside them), never scrolled
        # sideways; while searching, rows are two lines (the match under the title).
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setWordWrap(False)
        self.delegate = ConversationDelegate(self.list)
        self.list.setItemDelegate(self.delegate)
        self.empty = EmptyState("No conversations yet", "Your chats are listed here.", "Start a chat")
        self.empty.title.setFont(font_for("title", self.font()))  # the list is narrow: a smaller headline
        self.stack = EmptyStack(self.list, self.empty)
        layout.addWidget(self.stack, 1)
        for signal in (model.modelReset, model.rowsInserted, model.rowsRemoved):
            signal.connect(self._update_empty)

        buttons = QHBoxLayout()
        self.new_button = QPushButton("New")
        self.new_button.setAccessibleName("New conversation")
        self.new_button.setToolTip("New conversation (Ctrl+N)")
        self.rename_button = QPushButton("Rename")
        self.rename_button.setAccessibleName("Rename conversation")
        self.delete_button = QPushButton("Delete")
        self.delete_button.setAccessibleName("Delete conversation")
        for b in (self.new_button, self.rename_button, self.delete_button):
            buttons.addWidget(b)
        layout.addLayout(buttons)

        self.search.textChanged.connect(model.set_query)
        self.list.selectionModel().currentChanged.connect(self._on_current_changed)
        self.new_button.clicked.connect(self.newRequested)
        self.empty.actionRequested.connect(self.newRequested)
        self.rename_button.clicked.connect(self.rename_current)
        self.delete_button.clicked.connect(self.delete_current)
        self._current_id = 0
        self._update_empty()

    def _update_empty(self, *_args) -> None:
        if self.model.query:
            self.empty.set_message(
                "No matches", f"No conversation mentions “{self.model.query}”. Try other words.", ""
            )
        else:
            self.empty.set_message(
                "No conversations yet",
                "Your chats are listed here. Start one, or press Ctrl+N.",
                "Start a chat",
            )
        self.stack.set_empty(self.model.rowCount() == 0)

    def current_id(self) -> int:
        index = self.list.currentIndex()
        return int(index.data(ID_ROLE)) if index.isValid() else 0

    def select(self, conversation_id: int) -> None:
        """Highlight ``conversation_id`` without emitting a selection request."""
        self._current_id = conversation_id
        row = self.model.row_of(conversation_id)
        selection = self.list.selectionModel()
        blocked = selection.blockSignals(True)
        if row >= 0:
            index = self.model.index(row)
            selection.setCurrentIndex(index, QItemSelectionModel.SelectionFlag.ClearAndSelect)
        else:
            selection.clearSelection()
            selection.setCurrentIndex(QModelIndex(), QItemSelectionModel.SelectionFlag.Clear)
        selection.blockSignals(blocked)
        self.list.viewport().update()

    def refresh(self) -> None:
        self.model.refresh()
        self.select(self._current_id)

    def focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    def _on_current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():
            conversation_id = int(current.data(ID_ROLE))
            if conversation_id != self._current_id:
                self._current_id = conversation_id
                self.conversationSelected.emit(conversation_id)

    def set_dark(self, dark: bool) -> None:
        """The theme changed: the delegate's highlight colour follows it."""
        self.delegate.dark = dark
        self.list.viewport().update()

    def make_rename_dialog(self, title: str) -> QInputDialog:
        """The rename dialog, wide enough to read and edit a long title."""
        dialog = QInputDialog(self)
        dialog.setWindowTitle("Rename conversation")
        dialog.setLabelText("New title for this conversation:")
        dialog.setTextValue(title)
        dialog.setMinimumWidth(RENAME_DIALOG_WIDTH)
        dialog.resize(RENAME_DIALOG_WIDTH, dialog.sizeHint().height())
        return dialog

    def rename_current(self) -> None:
        cid = self.current_id()
        if not cid:
            return
        dialog = self.make_rename_dialog(self.list.currentIndex().data() or "")
        if dialog.exec() and dialog.textValue().strip():
            self.renameRequested.emit(cid, dialog.textValue().strip())

    def delete_current(self) -> None:
        cid = self.current_id()
        if not cid:
            return
        answer = QMessageBox.question(
            self, "Delete conversation", f"Delete “{self.list.currentIndex().data()}” and all its messages?"
        )
        if answer == QMessageBox.StandardButton.Yes:
            self.deleteRequested.emit(cid)
