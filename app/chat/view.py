"""The conversation view: one ``MessageWidget`` per row of a ``ChatMessageModel``.

A view only: it reads the model and follows its signals (reset, inserted, removed, changed) and
re-emits what the user asked for; it never writes the model or the store. A ``dataChanged`` for
one row touches that row's widget only, so a streaming reply re-renders one message, not the
conversation. Scrolling sticks to the bottom while the user is at the bottom, and stays put when
they have scrolled up to read. Long conversations are built a page at a time from the end;
scrolling to the top builds the previous page. On a wide window the messages keep to a centred
column of ``READING_WIDTH`` pixels, a comfortable line length.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QScrollArea, QVBoxLayout, QWidget

from app.chat.images import ImageLibrary
from app.chat.markdown import MarkdownRenderer
from app.chat.message_model import ChatMessageModel, Roles
from app.chat.message_widget import MessageWidget

# Messages get widgets a page at a time, newest first: opening a conversation of hundreds of
# messages builds ~40 widgets, not hundreds (widget construction and layout dominate its cost).
PAGE = 40

# The widest the column of messages gets; the sides stay empty beyond it.
READING_WIDTH = 980


class ChatView(QScrollArea):
    editSubmitted = Signal(int, str)
    branchRequested = Signal(int, int)
    regenerateRequested = Signal()
    deleteRequested = Signal(int)  # message id
    copied = Signal(str)
    imageOpened = Signal(str)  # sha256

    def __init__(
        self,
        model: ChatMessageModel,
        renderer: MarkdownRenderer,
        parent: QWidget | None = None,
        images: ImageLibrary | None = None,
    ) -> None:
        super().__init__(parent)
        self.setAccessibleName("Conversation")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.model = model
        self.renderer = renderer
        self.images = images
        self._widgets: list[MessageWidget] = []
        self._stick_to_bottom = True
        self._busy = False
        self._first = 0  # model rows before this have no widget yet
        self._anchor: tuple[int, int] | None = None
        self._highlight: tuple[list[str], str] = ([], "")

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
        bar.actionTriggered.connect(self._on_user_scroll)

        model.modelReset.connect(self._rebuild)
        model.rowsInserted.connect(self._on_rows_inserted)
        model.rowsRemoved.connect(lambda *_: self._rebuild())
        model.dataChanged.connect(self._on_data_changed)
        self._rebuild()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt naming)
        side = max(0, (self.viewport().width() - READING_WIDTH) // 2)
        self._layout.setContentsMargins(side, 0, side, 0)
        super().resizeEvent(event)

    # -- access for the pane and tests -----------------------------------------------------------

    def message_widget(self, row: int) -> MessageWidget:
        """The widget showing ``row`` (building older pages first if it is not built yet)."""
        while row < self._first:
            self._build_older()
        return self._widgets[row - self._first]

    def message_widgets(self) -> list[MessageWidget]:
        return list(self._widgets)

    @property
    def first_built_row(self) -> int:
        return self._first

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

    def set_highlight(self, terms: list[str], background: str) -> None:
        """Mark the words matching a search (``terms``, see app.conversations.highlight) in every
        message, including those built later; [] clears."""
        self._highlight = (list(terms), background)
        for w in self._widgets:
            w.set_highlight(terms, background)

    def highlighted(self) -> int:
        """How many matches are marked in the messages built so far."""
        return sum(w.highlighted() for w in self._widgets)

    def _make_widget(self) -> MessageWidget:
        w = MessageWidget(self.renderer, self.widget(), images=self.images)
        if self._highlight[0]:
            w.set_highlight(*self._highlight)
        w.editSubmitted.connect(self.editSubmitted)
        w.branchRequested.connect(self.branchRequested)
        w.regenerateRequested.connect(self.regenerateRequested)
        w.deleteRequested.connect(self.deleteRequested)
        w.copied.connect(self.copied)
        w.imageOpened.connect(self.imageOpened)
        return w

    def _rebuild(self) -> None:
        for w in self._widgets:
            self._layout.removeWidget(w)
            w.hide()  # deleteLater waits for the event loop; do not let it paint until then
            w.deleteLater()
        self._widgets = []
        count = self.model.rowCount()
        # Only the newest page gets widgets; older ones are built when scrolled to (see top).
        self._first = max(0, count - PAGE)
        self._insert_widgets(self._first, count - 1)
        self.scroll_to_bottom()

    def _insert_widgets(self, first: int, last: int) -> None:
        for row in range(first, last + 1):
            w = self._make_widget()
            self._widgets.insert(row - self._first, w)
            self._layout.insertWidget(row - self._first, w)
        self._refresh_rows(max(first - 1, self._first), self.model.rowCount() - 1)

    def _on_rows_inserted(self, _parent: QModelIndex, first: int, last: int) -> None:
        if first < self._first:
            self._rebuild()  # not how the chat grows (it appends); keep it simple and correct
            return
        self._insert_widgets(first, last)

    def _on_data_changed(self, top_left: QModelIndex, bottom_right: QModelIndex, _roles=()) -> None:
        self._refresh_rows(max(top_left.row(), self._first), bottom_right.row())

    def _refresh_rows(self, first: int, last: int) -> None:
        count = self.model.rowCount()
        for row in range(first, min(last, count - 1) + 1):
            item = self.model.data(self.model.index(row), Roles.ITEM)
            widget = self._widgets[row - self._first]
            widget.set_item(item, is_last=row == count - 1)
            widget.set_actions_enabled(not self._busy)

    def _build_older(self) -> None:
        """Give the previous page of messages their widgets, keeping the view where it was."""
        if self._first == 0:
            return
        bar = self.verticalScrollBar()
        self._anchor = (bar.maximum(), bar.value())
        old_first = self._first
        self._first = max(0, old_first - PAGE)
        for _ in range(old_first - self._first):
            w = self._make_widget()
            self._widgets.insert(0, w)
            self._layout.insertWidget(0, w)
        self._refresh_rows(self._first, old_first - 1)

    # -- scrolling -----------------------------------------------------------------------------------

    def _on_scrolled(self, value: int) -> None:
        self._stick_to_bottom = value >= self.verticalScrollBar().maximum() - 8

    def _on_user_scroll(self, _action: int) -> None:
        # actionTriggered comes from the user (wheel, keys, dragging) and before the move is
        # applied, so look after it; layout changes never trigger it, unlike valueChanged.
        QTimer.singleShot(0, self._maybe_build_older)

    def _maybe_build_older(self) -> None:
        bar = self.verticalScrollBar()
        if bar.value() <= bar.minimum() + 4 and self._first > 0 and self._anchor is None:
            self._build_older()

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        bar = self.verticalScrollBar()
        if self._anchor is not None:
            # Older messages appeared above: keep the ones the user was reading in place.
            old_maximum, old_value = self._anchor
            self._anchor = None
            bar.setValue(old_value + maximum - old_maximum)
        elif self._stick_to_bottom:
            bar.setValue(maximum)
