"""The strip above the composer: thumbnails of the images attached to the message being written.

A view over an ``AttachmentListModel``: it rebuilds its thumbnails when the model changes and
re-emits what the user asked for (open one full size, remove one); the pane changes the model.
It also carries the notice that the loaded model cannot see images, next to the images it
concerns, before the user presses Send.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.chat.attachments import AttachmentListModel
from app.chat.images import ThumbnailRow


class AttachmentStrip(QWidget):
    def __init__(self, model: AttachmentListModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Attached images")
        self.model = model
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 0, 8, 0)
        layout.setSpacing(2)
        self.row = ThumbnailRow(removable=True, parent=self)
        self.notice = QLabel()
        self.notice.setAccessibleName("Image notice")
        self.notice.setWordWrap(True)
        self.notice.setStyleSheet("QLabel { color: #b26a00; }")
        self.notice.hide()
        layout.addWidget(self.row)
        layout.addWidget(self.notice)
        self.opened = self.row.opened
        self.removeRequested = self.row.removeRequested
        model.modelReset.connect(self._rebuild)
        model.rowsInserted.connect(self._rebuild)
        model.rowsRemoved.connect(self._rebuild)
        self._notice_text = ""
        self._rebuild()

    def set_notice(self, text: str, refused: bool = False) -> None:
        """Shown while images are attached (e.g. "this model cannot see images"); "" hides it.
        ``refused``: a send was just refused for this reason, so say so, in the error colour."""
        self._notice_text = f"Not sent: {text}" if refused and text else text
        self.notice.setStyleSheet(f"QLabel {{ color: {'#c62828' if refused else '#b26a00'}; }}")
        self._update_notice()

    def _rebuild(self, *_args) -> None:
        model = self.model
        thumbnails = []
        for row in range(model.rowCount()):
            index = model.index(row)
            thumbnails.append(
                (
                    model.data(index, Qt.ItemDataRole.DecorationRole),
                    model.data(index, Qt.ItemDataRole.ToolTipRole),
                )
            )
        self.row.set_thumbnails(thumbnails)
        self.setVisible(bool(thumbnails))
        self._update_notice()

    def _update_notice(self) -> None:
        self.notice.setText(self._notice_text)
        self.notice.setVisible(bool(self._notice_text) and self.model.rowCount() > 0)
