"""One message on screen: a role block with a header (avatar, who, when, status, and the actions)
and its rendered body, indented under the name.

The actions (version switcher, Copy, Edit, Regenerate, Delete) sit in a toolbar that shows while the
pointer is over the message or the keyboard focus is in it, as does the time it was written (its
full date is the tooltip); otherwise both are transparent, not hidden, so nothing moves when they
appear and the buttons keep their place in the tab order.

The body is a ``QTextBrowser`` sized to its document so the conversation scrolls as one page
(the scroll area around all messages does the scrolling, not each message). Assistant messages
are Markdown; user messages are shown as typed.

Streaming without stalls: re-rendering a whole long reply on every update costs tens of
milliseconds (Markdown, highlighting, and above all QTextDocument layout), growing with its
length. So a streaming reply is shown in *pieces*: once the tail has grown past
``FREEZE_CHARS``, its stable blocks (every top-level Markdown block but the last, which later text
can no longer change) are rendered one final time into a frozen piece, and updates re-render only
the short tail piece. The cost of an update is then bounded by the tail, not by the reply. On top
of that, if renders still get slow they are spaced out to a few times their own cost, so the GUI
thread always has time for input and painting. A message loaded from disk is one piece.
"""

from __future__ import annotations

import html
import time
from datetime import datetime

from PySide6.QtCore import QEvent, QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QGuiApplication,
    QKeyEvent,
    QPalette,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QGraphicsOpacityEffect,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QTextBrowser,
    QTextEdit,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.avatar import AVATAR_SIZE, Avatar
from app.chat.images import ImageLibrary, ThumbnailRow
from app.chat.markdown import MarkdownRenderer, plain_text_html
from app.chat.message_model import MessageItem
from app.chat.structured import display_text
from app.conversations.highlight import HIGHLIGHT_BACKGROUND, match_spans
from app.theme import SPACE_M, SPACE_S, SPACE_XS, font_for
from app.tools.calls_view import ToolCallsView

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
STOP_LABELS = {
    "cancelled": "stopped",
    "max_new_tokens": "hit the token limit",
    "context_length": "context is full",
    "stop_string": "",
    "eos": "",
    "error": "failed",
    "constraint_complete": "",
    "constraint_error": "does not fit the JSON schema",
}


class MessageBody(QTextBrowser):
    """A read-only rich-text view whose height follows its content."""

    copyRequested = Signal(int)  # index of the code block whose Copy link was clicked

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        # Transparent, so the message's background shows through. (Not a style sheet: a widget
        # with one stops following application palette changes, i.e. light/dark switches.)
        self.viewport().setAutoFillBackground(False)
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self.anchorClicked.connect(self._on_anchor)
        self.setFixedHeight(24)
        self._terms: list[str] = []
        self._highlight = QColor(HIGHLIGHT_BACKGROUND[0])
        self.textChanged.connect(self._mark_matches)  # every render replaces the document

    def set_highlight(self, terms: list[str], background: str = HIGHLIGHT_BACKGROUND[0]) -> None:
        """Mark every word starting with one of ``terms`` (a search's matches); [] clears."""
        self._terms, self._highlight = list(terms), QColor(background)
        self._mark_matches()

    def highlighted(self) -> int:
        """How many matches are marked."""
        return len(self.extraSelections())

    def _mark_matches(self) -> None:
        selections = []
        for start, end in match_spans(self.toPlainText(), self._terms):
            selection = QTextEdit.ExtraSelection()
            selection.cursor = QTextCursor(self.document())
            selection.cursor.setPosition(start)
            selection.cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
            fmt = QTextCharFormat()
            fmt.setBackground(self._highlight)
            selection.format = fmt
            selections.append(selection)
        self.setExtraSelections(selections)

    def _fit(self, *_args) -> None:
        height = int(self.document().size().height() + 0.999) + 2 * self.frameWidth()
        if height != self.height():
            self.setFixedHeight(max(height, 16))

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt naming)
        super().resizeEvent(event)
        self._fit()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(super().sizeHint().width(), self.height())

    def wheelEvent(self, event) -> None:  # noqa: N802
        event.ignore()  # let the conversation's scroll area scroll

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == "copy":
            try:
                self.copyRequested.emit(int(url.path()))
            except ValueError:
                pass
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)


class _EditBox(QPlainTextEdit):
    """Editor for a past user message: Enter sends, Shift+Enter is a new line, Esc cancels."""

    submitted = Signal()
    cancelled = Signal()

    def event(self, event: QEvent) -> bool:
        # Claim Esc before the window's "stop reply" shortcut sees it: here it cancels the edit.
        if event.type() == QEvent.Type.ShortcutOverride and event.key() == Qt.Key.Key_Escape:
            event.accept()
            return True
        return super().event(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submitted.emit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.cancelled.emit()
            return
        super().keyPressEvent(event)


FREEZE_CHARS = 400


def message_time(created_at: float, now: float | None = None) -> tuple[str, str]:
    """(short, full) texts for when a message was written: "14:03" today, "5 Dec, 14:03" before,
    with the year when it is not this one; ("", "") for a message not stored yet."""
    if created_at <= 0:
        return "", ""
    when = datetime.fromtimestamp(created_at)
    today = datetime.fromtimestamp(now if now is not None else time.time())
    if when.date() == today.date():
        short = when.strftime("%H:%M")
    elif when.year == today.year:
        short = f"{when.day} {when.strftime('%b, %H:%M')}"
    else:
        short = f"{when.day} {when.strftime('%b %Y, %H:%M')}"
    full = f"{when.strftime('%A')} {when.day} {when.strftime('%B %Y, %H:%M:%S')}"
    return short, full


class MessageWidget(QFrame):
    editSubmitted = Signal(int, str)  # message id, new text
    branchRequested = Signal(int, int)  # message id, -1 / +1
    regenerateRequested = Signal()
    deleteRequested = Signal(int)  # message id
    copied = Signal(str)
    imageOpened = Signal(str)  # sha256 of the thumbnail clicked

    def __init__(
        self, renderer: MarkdownRenderer, parent: QWidget | None = None, images: ImageLibrary | None = None
    ) -> None:
        super().__init__(parent)
        self.renderer = renderer
        self.images = images
        self.thumbnails: ThumbnailRow | None = None  # built for the first message with images
        self._shown_images: list[str] = []
        self.item: MessageItem | None = None
        self.code_blocks: list[str] = []
        self.render_count = 0
        self._shown: tuple | None = None
        self._render_cost = 0.0
        self._last_render = 0.0
        self._deferred = QTimer(self)
        self._deferred.setSingleShot(True)
        self._deferred.timeout.connect(self._render)

        self._edit_box: QWidget | None = None  # built on first "Edit" (see below)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setAutoFillBackground(True)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(SPACE_M, SPACE_S, SPACE_M, SPACE_S)
        outer.setSpacing(SPACE_XS)

        header = QHBoxLayout()
        header.setSpacing(SPACE_S)
        self.avatar = Avatar(self)
        self.role_label = QLabel()
        self.role_label.setFont(font_for("label", self.role_label.font()))
        self.time_label = QLabel()
        self.time_label.setAccessibleName("Written at")
        self.time_label.setFont(font_for("caption", self.time_label.font()))
        self.time_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.status_label = QLabel()
        self.status_label.setFont(font_for("caption", self.status_label.font()))
        self.status_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        header.addWidget(self.avatar)
        header.addWidget(self.role_label)
        header.addWidget(self.time_label)
        header.addWidget(self.status_label)
        header.addStretch(1)

        # The hover toolbar: every action on this message.
        self.actions_bar = QWidget(self)
        self.actions_bar.setAccessibleName("Message actions")
        bar = QHBoxLayout(self.actions_bar)
        bar.setContentsMargins(0, 0, 0, 0)
        bar.setSpacing(0)
        self.prev_button = self._tool("‹", "Previous version")
        self.branch_label = QLabel()
        self.branch_label.setAccessibleName("Version")
        self.next_button = self._tool("›", "Next version")
        self.copy_button = self._tool("Copy", "Copy message")
        self.edit_button = self._tool("Edit", "Edit message")
        self.regenerate_button = self._tool("Regenerate", "Regenerate reply")
        self.delete_button = self._tool("Delete", "Delete message")
        for w in (
            self.prev_button,
            self.branch_label,
            self.next_button,
            self.copy_button,
            self.edit_button,
            self.regenerate_button,
            self.delete_button,
        ):
            bar.addWidget(w)
        header.addWidget(self.actions_bar)
        self._hover_effects: list[QGraphicsOpacityEffect] = []
        for widget in (self.actions_bar, self.time_label):
            effect = QGraphicsOpacityEffect(widget)
            widget.setGraphicsEffect(effect)
            self._hover_effects.append(effect)
        self.set_hovered(False)
        outer.addLayout(header)

        # Everything under the header is indented to the name, past the avatar.
        layout = QVBoxLayout()
        layout.setContentsMargins(AVATAR_SIZE + SPACE_S, 0, 0, 0)
        layout.setSpacing(SPACE_XS)
        outer.addLayout(layout)

        # The body: one MessageBody per piece (see the module docstring), stacked without gaps.
        self.body_box = QWidget(self)
        self._pieces_layout = QVBoxLayout(self.body_box)
        self._pieces_layout.setContentsMargins(0, 0, 0, 0)
        self._pieces_layout.setSpacing(0)
        self.pieces: list[MessageBody] = []
        self._frozen_chars = 0  # length of the content shown by all pieces but the last
        self._frozen_code_blocks: list[str] = []
        self._reset_pieces()
        layout.addWidget(self.body_box)
        self.tool_calls: ToolCallsView | None = None  # built for replies that called tools

        # The editor for "Edit" is built on first use: a long conversation has hundreds of
        # messages and widget construction is most of the cost of opening it.
        self.editor: _EditBox | None = None
        self._edit_box: QWidget | None = None
        self._layout = layout

        self.stats_label = QLabel()
        self.stats_label.setFont(font_for("caption", self.stats_label.font()))
        self.stats_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.stats_label.setAccessibleName("Reply statistics")
        layout.addWidget(self.stats_label)

        self.prev_button.clicked.connect(lambda: self._branch(-1))
        self.next_button.clicked.connect(lambda: self._branch(+1))
        self.copy_button.clicked.connect(self._copy_message)
        self.edit_button.clicked.connect(self.start_edit)
        self.regenerate_button.clicked.connect(self.regenerateRequested)
        self.delete_button.clicked.connect(self._delete)

    def _tool(self, text: str, accessible: str) -> QToolButton:
        button = QToolButton(self)
        button.setText(text)
        button.setToolTip(accessible)
        button.setAccessibleName(accessible)
        button.setAutoRaise(True)
        return button

    # -- hover -----------------------------------------------------------------------------------

    def hover_shown(self) -> bool:
        """Whether the actions and the time are showing (pointer over the message, or focus in it)."""
        return self._hover_effects[0].opacity() > 0.5

    def set_hovered(self, hovered: bool) -> None:
        editing = self._edit_box is not None and not self._edit_box.isHidden()
        focus = QApplication.focusWidget()
        shown = hovered or editing or (focus is not None and self.actions_bar.isAncestorOf(focus))
        for effect in self._hover_effects:
            effect.setOpacity(1.0 if shown else 0.0)

    def enterEvent(self, event) -> None:  # noqa: N802 (Qt naming)
        self.set_hovered(True)
        super().enterEvent(event)

    def leaveEvent(self, event) -> None:  # noqa: N802
        self.set_hovered(False)
        super().leaveEvent(event)

    # -- display ---------------------------------------------------------------------------------

    def set_item(self, item: MessageItem, is_last: bool) -> None:
        self.item = item
        name = ROLE_NAMES.get(item.role, item.role)
        self.setAccessibleName(f"{name} message")
        self.role_label.setText(name)
        self.avatar.set_role(item.role, name)
        short, full = message_time(item.created_at)
        self.time_label.setText(short)
        for label in (self.time_label, self.role_label, self.avatar):
            label.setToolTip(full)
        self.setBackgroundRole(
            QPalette.ColorRole.AlternateBase if item.role == "user" else QPalette.ColorRole.Base
        )
        many = item.sibling_count > 1
        for w in (self.prev_button, self.branch_label, self.next_button):
            w.setVisible(many)
        self.branch_label.setText(f"{item.sibling_index + 1}/{item.sibling_count}")
        self.prev_button.setEnabled(item.sibling_index > 0)
        self.next_button.setEnabled(item.sibling_index < item.sibling_count - 1)
        self.edit_button.setVisible(item.role == "user" and not item.streaming)
        self.regenerate_button.setVisible(item.role == "assistant" and is_last and not item.streaming)
        self.copy_button.setVisible(not item.streaming)
        self.delete_button.setVisible(not item.streaming)
        self.delete_button.setToolTip(
            "Delete this message and its reply"
            if item.role == "user"
            else "Delete this reply (all its versions)"
        )
        status = self._status(item)
        if many:  # the switcher only shows on hover: say here that there are other versions
            version = f"version {item.sibling_index + 1} of {item.sibling_count}"
            status = f"{status} · {version}" if status else version
        self.status_label.setText(status)
        if item.images != self._shown_images:
            self._show_images(item.images)
        if item.tool_calls or self.tool_calls is not None:
            if self.tool_calls is None:
                self.tool_calls = ToolCallsView(self)
                self._layout.insertWidget(self._layout.indexOf(self.body_box) + 1, self.tool_calls)
            self.tool_calls.set_calls(item.tool_calls)
        self.stats_label.setText(self._stats(item))
        self.stats_label.setVisible(bool(self.stats_label.text()))
        # The model may mutate a streaming item in place, so compare with what was last rendered,
        # not with the previous item object.
        shown = (item.role, item.content, item.streaming, item.error, item.stats.get("stop_reason"))
        if shown != self._shown:
            self._shown = shown
            self._schedule_render(item.streaming)

    def _show_images(self, shas: list[str]) -> None:
        self._shown_images = list(shas)
        if self.thumbnails is None:
            if not shas or self.images is None:
                return
            self.thumbnails = ThumbnailRow(parent=self)
            self.thumbnails.setAccessibleName("Attached images")
            self.thumbnails.opened.connect(lambda i: self.imageOpened.emit(self._shown_images[i]))
            # Above the text: the images come first in the prompt too.
            self._layout.insertWidget(self._layout.indexOf(self.body_box), self.thumbnails)
        library = self.images
        self.thumbnails.set_thumbnails(
            [(library.thumbnail(sha), "Attached image") for sha in shas] if library is not None else []
        )

    def set_actions_enabled(self, enabled: bool) -> None:
        """While a reply streams, actions that would start another one or change the conversation
        under it (edit, regenerate, switch branch, delete) are disabled; Copy stays available."""
        for button in (self.edit_button, self.regenerate_button, self.delete_button):
            button.setEnabled(enabled)
        item = self.item
        self.prev_button.setEnabled(enabled and item is not None and item.sibling_index > 0)
        self.next_button.setEnabled(
            enabled and item is not None and item.sibling_index < item.sibling_count - 1
        )

    def rerender(self) -> None:
        """Render again with the current renderer (theme or font change), as one piece."""
        self._reset_pieces()
        self._render()

    @property
    def body(self) -> MessageBody:
        """The first piece (the whole body unless a long reply was streamed)."""
        return self.pieces[0]

    def plain_text(self) -> str:
        return "".join(piece.toPlainText() for piece in self.pieces)

    def set_highlight(self, terms: list[str], background: str = HIGHLIGHT_BACKGROUND[0]) -> None:
        """Mark a search's matches in this message (every piece, and pieces still to come)."""
        self._highlight_terms = (list(terms), background)
        for piece in self.pieces:
            piece.set_highlight(terms, background)

    def highlighted(self) -> int:
        return sum(piece.highlighted() for piece in self.pieces)

    def _add_piece(self) -> MessageBody:
        piece = MessageBody(self.body_box)
        piece.setAccessibleName("Message text")
        piece.copyRequested.connect(self._copy_block)
        terms, background = getattr(self, "_highlight_terms", ([], HIGHLIGHT_BACKGROUND[0]))
        if terms:
            piece.set_highlight(terms, background)
        self._pieces_layout.addWidget(piece)
        self.pieces.append(piece)
        return piece

    def _reset_pieces(self) -> None:
        for piece in self.pieces[1:]:
            # Hidden at once: deleteLater only runs when control returns to the event loop, and
            # until then the old piece would still paint over its successors.
            self._pieces_layout.removeWidget(piece)
            piece.hide()
            piece.deleteLater()
        self.pieces = self.pieces[:1]
        if not self.pieces:
            self._add_piece()
        self._frozen_chars = 0
        self._frozen_code_blocks = []

    def _schedule_render(self, streaming: bool) -> None:
        if not streaming:
            self._deferred.stop()
            self._render()
            return
        # Keep renders of a growing reply at most ~1/3 of the GUI thread's time.
        wait_ms = (self._last_render + 3 * self._render_cost - time.perf_counter()) * 1000
        if wait_ms <= 0:
            self._render()
        elif not self._deferred.isActive():
            self._deferred.start(int(wait_ms) + 1)

    def _render(self) -> None:
        item = self.item
        if item is None:
            return
        started = time.perf_counter()
        if item.role != "assistant":
            self._reset_pieces()
            self.code_blocks = []
            self.pieces[0].setHtml(plain_text_html(item.content))
        elif not item.content and not item.streaming and item.error:
            self._reset_pieces()
            self.code_blocks = []
            self.pieces[0].setHtml(f"<p><i>{html.escape(item.error)}</i></p>")
        else:
            self._render_markdown(item)
        self._last_render = time.perf_counter()
        self._render_cost = self._last_render - started
        self.render_count += 1

    def _render_markdown(self, item: MessageItem) -> None:
        # A finished structured reply is shown as formatted JSON (the stored text stays raw).
        content = item.content if item.streaming else display_text(item.content, item.stats)
        frozen = content[: self._frozen_chars]
        if len(frozen) != self._frozen_chars or not content.startswith(frozen):
            self._reset_pieces()  # the text was replaced, not extended: start over
        tail = content[self._frozen_chars :]
        if item.streaming and len(tail) > FREEZE_CHARS:
            stable = self.renderer.stable_prefix_length(tail)
            if stable > 0:
                done = self.renderer.render(tail[:stable], len(self._frozen_code_blocks))
                self.pieces[-1].setHtml(done.html)
                self._frozen_code_blocks += done.code_blocks
                self._frozen_chars += stable
                tail = tail[stable:]
                self._add_piece()
        text = tail + " ▍" if item.streaming else tail  # a caret while the reply is coming
        rendered = self.renderer.render(text, len(self._frozen_code_blocks))
        self.pieces[-1].setHtml(rendered.html)
        self.code_blocks = self._frozen_code_blocks + rendered.code_blocks

    @staticmethod
    def _status(item: MessageItem) -> str:
        if item.streaming:
            return "writing…"
        if not item.complete:
            return "interrupted"
        return STOP_LABELS.get(item.stats.get("stop_reason") or "", "")

    @staticmethod
    def _stats(item: MessageItem) -> str:
        if item.role != "assistant" or item.streaming:
            return ""
        parts = []
        if item.error:
            parts.append(item.error)
        tokens = item.stats.get("new_tokens")
        if tokens:
            parts.append(f"{tokens} tokens")
        tps = item.stats.get("tokens_per_second")
        if tps:
            parts.append(f"{tps:.1f} tok/s")
        trimmed = item.stats.get("trimmed_messages")
        if trimmed:
            parts.append(f"{trimmed} earliest messages left out to fit the context")
        left_out = item.stats.get("images_left_out")
        if left_out:
            parts.append(
                f"{left_out} image{'s' if left_out > 1 else ''} left out: this model cannot see images"
            )
        return " · ".join(parts)

    # -- actions ---------------------------------------------------------------------------------

    def _branch(self, delta: int) -> None:
        if self.item is not None:
            self.branchRequested.emit(self.item.id, delta)

    def _delete(self) -> None:
        if self.item is not None:
            self.deleteRequested.emit(self.item.id)

    def _copy_message(self) -> None:
        if self.item is not None:
            QGuiApplication.clipboard().setText(self.item.content)
            self.copied.emit(self.item.content)

    def _copy_block(self, index: int) -> None:
        if 0 <= index < len(self.code_blocks):
            QGuiApplication.clipboard().setText(self.code_blocks[index])
            self.copied.emit(self.code_blocks[index])

    def _build_editor(self) -> _EditBox:
        box = QWidget(self)
        column = QVBoxLayout(box)
        column.setContentsMargins(0, 0, 0, 0)
        editor = _EditBox(box)
        editor.setAccessibleName("Edit message text")
        editor.setFixedHeight(90)
        send = QPushButton("Send edited message", box)
        send.setAccessibleName("Send edited message")
        cancel = QPushButton("Cancel", box)
        cancel.setAccessibleName("Cancel editing")
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(cancel)
        row.addWidget(send)
        column.addWidget(editor)
        column.addLayout(row)
        self._layout.insertWidget(self._layout.indexOf(self.body_box) + 1, box)
        send.clicked.connect(self._send_edit)
        cancel.clicked.connect(lambda: self._set_editing(False))
        editor.submitted.connect(self._send_edit)
        editor.cancelled.connect(lambda: self._set_editing(False))
        self.editor, self._edit_box = editor, box
        return editor

    def start_edit(self) -> None:
        if self.item is None or self.item.role != "user":
            return
        editor = self.editor or self._build_editor()
        editor.setPlainText(self.item.content)
        self._set_editing(True)
        editor.setFocus()

    def _set_editing(self, editing: bool) -> None:
        if self._edit_box is not None:
            self._edit_box.setVisible(editing)
        self.body_box.setVisible(not editing)

    def _send_edit(self) -> None:
        if self.item is None or self.editor is None:
            return
        text = self.editor.toPlainText().strip()
        self._set_editing(False)
        if text and text != self.item.content:
            self.editSubmitted.emit(self.item.id, text)
