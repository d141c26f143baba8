"""The conversation view: one ``MessageWidget`` per row of a ``ChatMessageModel``.

A view only: it reads the model and follows its signals (reset, inserted, removed, changed) and
re-emits what the user asked for; it never writes the model or the store. A ``dataChanged`` for
one row touches that row's widget only, so a streaming reply re-renders one message, not the
conversation. Scrolling sticks to the bottom while the user is at the bottom, and stays put when
they have scrolled up to read.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, Qt, Signal
from PySide6.QtWidgets import QFrame, QScrollArea, QVBoxLayout, QWidget

from app.chat.markdown import MarkdownRenderer
from app.chat.message_model import ChatMessageModel, Roles
from app.chat.message_widget import MessageWidget


class ChatView(QScrollArea):
    editSubmitted = Signal(int, str)
    branchRequested = Signal(int, int)
    regenerateRequested = Signal()
    copied = Signal(str)

    def __init__(
        self, model: ChatMessageModel, renderer: MarkdownRenderer, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.setAccessibleName("Conversation")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.model = model
        self.renderer = renderer
        self._widgets: list[MessageWidget] = []
        self._stick_to_bottom = True
        self._busy = False

        container = QWidget()
        container.setBackgroundRole(self.backgroundRole())
        self._layout = QVBoxLayout(container)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(1)
        self._layout.addStretch(1)
        self.setWidget(container)

        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range_changed)

        model.modelReset.connect(self._rebuild)
        model.rowsInserted.connect(self._on_rows_inserted)
        model.rowsRemoved.connect(lambda *_: self._rebuild())
        model.dataChanged.connect(self._on_data_changed)
        self._rebuild()

    # -- access for the pane and tests -----------------------------------------------------------

    def message_widget(self, row: int) -> MessageWidget:
        return self._widgets[row]

    def message_widgets(self) -> list[MessageWidget]:
        return list(self._widgets)

    def set_renderer(self, renderer: MarkdownRenderer) -> None:
        self.renderer = renderer
        for w in self._widgets:
            w.renderer = renderer
            w.rerender()

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        for w in self._widgets:
            w.set_actions_enabled(not busy)

    def scroll_to_bottom(self) -> None:
        self._stick_to_bottom = True
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    # -- model signals -----------------------------------------------------------------------------

    def _make_widget(self) -> MessageWidget:
        w = MessageWidget(self.renderer, self.widget())
        w.editSubmitted.connect(self.editSubmitted)
        w.branchRequested.connect(self.branchRequested)
        w.regenerateRequested.connect(self.regenerateRequested)
        w.copied.connect(self.copied)
        return w

    def _rebuild(self) -> None:
        for w in self._widgets:
            self._layout.removeWidget(w)
            w.hide()  # deleteLater waits for the event loop; do not let it paint until then
            w.deleteLater()
        self._widgets = []
        self._on_rows_inserted(QModelIndex(), 0, self.model.rowCount() - 1)
        self.scroll_to_bottom()

    def _on_rows_inserted(self, _parent: QModelIndex, first: int, last: int) -> None:
        for row in range(first, last + 1):
            w = self._make_widget()
            self._widgets.insert(row, w)
            self._layout.insertWidget(row, w)
        self._refresh_rows(max(first - 1, 0), self.model.rowCount() - 1)

    def _on_data_changed(self, top_left: QModelIndex, bottom_right: QModelIndex, _roles=()) -> None:
        self._refresh_rows(top_left.row(), bottom_right.row())

    def _refresh_rows(self, first: int, last: int) -> None:
        count = self.model.rowCount()
        for row in range(first, min(last, count - 1) + 1):
            item = self.model.data(self.model.index(row), Roles.ITEM)
            self._widgets[row].set_item(item, is_last=row == count - 1)
            self._widgets[row].set_actions_enabled(not self._busy)

    # -- scrolling -----------------------------------------------------------------------------------

    def _on_scrolled(self, value: int) -> None:
        self._stick_to_bottom = value >= self.verticalScrollBar().maximum() - 8

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._stick_to_bottom:
            self.verticalScrollBar().setValue(maximum)
