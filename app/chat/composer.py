"""Where the user types: Enter sends, Shift+Enter starts a new line; images can be dropped or
pasted in.

Drops and pastes both arrive through ``insertFromMimeData`` (that is how ``QPlainTextEdit``
implements them), so one override catches both: mime data that holds files or image data is
offered as attachments (``attachmentsOffered``) instead of being inserted as text; anything
else is text as before. The composer does not read or keep images itself: the chat pane owns
the list of pending attachments.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QMimeData, Qt, Signal
from PySide6.QtGui import QKeyEvent, QKeySequence
from PySide6.QtWidgets import QPlainTextEdit, QWidget

from app.chat.attachments import sources_from_mime


class Composer(QPlainTextEdit):
    submitted = Signal(str)
    attachmentsOffered = Signal(list)  # file paths and QImages (see attachments.sources_from_mime)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Message input")
        self.setPlaceholderText(
            "Message the model (Enter to send, Shift+Enter for a new line; drop or paste images)"
        )
        self.setTabChangesFocus(True)
        self.setFixedHeight(84)
        self._has_attachments = False

    def set_has_attachments(self, has: bool) -> None:
        """With images attached, a message may be sent without text ("what is this?" is implied)."""
        self._has_attachments = has

    def event(self, event: QEvent) -> bool:
        # With no typing to undo, Ctrl+Z is left to the window's Edit > Undo (it brings back
        # deleted messages); a text box would otherwise claim the key and do nothing.
        if (
            event.type() == QEvent.Type.ShortcutOverride
            and event.matches(QKeySequence.StandardKey.Undo)
            and not self.document().isUndoAvailable()
        ):
            event.ignore()
            return False
        return super().event(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 (Qt naming)
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not (event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submit()
            return
        super().keyPressEvent(event)

    def submit(self) -> None:
        text = self.toPlainText()
        if text.strip() or self._has_attachments:
            self.submitted.emit(text)

    # -- drops and pastes ----------------------------------------------------------------------

    def canInsertFromMimeData(self, source: QMimeData) -> bool:  # noqa: N802 (Qt naming)
        return bool(sources_from_mime(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:  # noqa: N802 (Qt naming)
        sources = sources_from_mime(source)
        if sources:
            self.attachmentsOffered.emit(sources)
        else:
            super().insertFromMimeData(source)
