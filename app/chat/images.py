"""Showing images: thumbnails, a row of clickable thumbnails, and a full-size viewer.

Thumbnails are decoded straight at their small size (``QImageReader.setScaledSize``: JPEG
decodes at a fraction of the cost of the full picture) and cached by content hash, so a
conversation that shows the same image in several messages, or is re-opened, decodes it once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QSize, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QImage, QImageReader, QPainter, QPixmap
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

THUMBNAIL_SIZE = 72  # pixels, the longer side


def _reader(data: bytes) -> tuple[QImageReader, QBuffer]:
    buffer = QBuffer()
    buffer.setData(QByteArray(data))
    buffer.open(QIODevice.OpenModeFlag.ReadOnly)
    reader = QImageReader(buffer)
    reader.setAutoTransform(True)  # show photos upright (EXIF orientation)
    return reader, buffer  # the buffer must outlive the reader's use


def decode_image(data: bytes) -> QImage:
    """The full image (a null QImage when Qt cannot decode it)."""
    reader, _buffer = _reader(data)
    return reader.read()


def thumbnail_pixmap(data: bytes, size: int = THUMBNAIL_SIZE) -> QPixmap:
    """A thumbnail whose longer side is ``size``; a placeholder for what cannot be decoded."""
    reader, _buffer = _reader(data)
    full = reader.size()
    if full.isValid() and (full.width() > size or full.height() > size):
        reader.setScaledSize(full.scaled(size, size, Qt.AspectRatioMode.KeepAspectRatio))
    image = reader.read()
    if image.isNull():
        return placeholder_pixmap(size)
    return QPixmap.fromImage(image)


def placeholder_pixmap(size: int) -> QPixmap:
    """A grey square with a question mark: an image Qt cannot show (the engine may still read it)."""
    pixmap = QPixmap(size, size)
    pixmap.fill(QColor("#9e9e9e"))
    painter = QPainter(pixmap)
    painter.setPen(QColor("white"))
    painter.drawText(pixmap.rect(), Qt.AlignmentFlag.AlignCenter, "?")
    painter.end()
    return pixmap


class ImageLibrary:
    """Thumbnails and full images of stored images, by sha256 (GUI thread only).

    ``read`` returns an image's encoded bytes (``Store.image_data``); kept as a callable so the
    views never hold the store itself.
    """

    def __init__(self, read: Callable[[str], bytes], capacity: int = 256) -> None:
        self._read = read
        self._thumbnails: OrderedDict[str, QPixmap] = OrderedDict()
        self._capacity = capacity

    def thumbnail(self, sha256: str) -> QPixmap:
        pixmap = self._thumbnails.get(sha256)
        if pixmap is not None:
            self._thumbnails.move_to_end(sha256)
            return pixmap
        try:
            pixmap = thumbnail_pixmap(self._read(sha256))
        except KeyError:  # deleted meanwhile (its conversation was deleted)
            return placeholder_pixmap(THUMBNAIL_SIZE)
        self._thumbnails[sha256] = pixmap
        while len(self._thumbnails) > self._capacity:
            self._thumbnails.popitem(last=False)
        return pixmap

    def image(self, sha256: str) -> QImage:
        try:
            return decode_image(self._read(sha256))
        except KeyError:
            return QImage()


class ThumbnailRow(QWidget):
    """A row of clickable thumbnails; with ``removable``, each has a remove (×) button."""

    opened = Signal(int)  # index of the thumbnail clicked
    removeRequested = Signal(int)

    def __init__(self, removable: bool = False, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.removable = removable
        self._layout = QHBoxLayout(self)
        self._layout.setContentsMargins(0, 2, 0, 2)
        self._layout.setSpacing(6)
        self._layout.addStretch(1)
        self.buttons: list[QToolButton] = []
        self.remove_buttons: list[QToolButton] = []
        self._cells: list[QWidget] = []

    def set_thumbnails(self, thumbnails: list[tuple[QPixmap, str]]) -> None:
        """(pixmap, tooltip) per image, in order."""
        for cell in self._cells:
            self._layout.removeWidget(cell)
            cell.hide()
            cell.deleteLater()
        self._cells, self.buttons, self.remove_buttons = [], [], []
        for index, (pixmap, tooltip) in enumerate(thumbnails):
            cell = QWidget(self)
            row = QHBoxLayout(cell)
            row.setContentsMargins(0, 0, 0, 0)
            row.setSpacing(0)
            button = QToolButton(cell)
            button.setIcon(QIcon(pixmap))
            button.setIconSize(QSize(THUMBNAIL_SIZE, THUMBNAIL_SIZE))
            button.setAutoRaise(True)
            button.setToolTip(f"{tooltip}\nClick to view full size")
            button.setAccessibleName(f"Image {index + 1}")
            button.setCursor(Qt.CursorShape.PointingHandCursor)
            button.clicked.connect(lambda _=False, i=index: self.opened.emit(i))
            row.addWidget(button)
            self.buttons.append(button)
            if self.removable:
                remove = QToolButton(cell)
                remove.setText("×")
                remove.setToolTip("Remove this image")
                remove.setAccessibleName(f"Remove image {index + 1}")
                remove.setAutoRaise(True)
                remove.clicked.connect(lambda _=False, i=index: self.removeRequested.emit(i))
                row.addWidget(remove, 0, Qt.AlignmentFlag.AlignTop)
                self.remove_buttons.append(remove)
            self._layout.insertWidget(index, cell)
            self._cells.append(cell)
        self.setVisible(bool(thumbnails))


class ImageViewer(QDialog):
    """An image at full size, scaled down only to fit the screen; scrolls if asked to zoom."""

    def __init__(self, image: QImage, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        self.setAccessibleName("Image viewer")
        self.image = image
        layout = QVBoxLayout(self)
        self.label = QLabel()
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.label.setAccessibleName("Full-size image")
        scroll = QScrollArea()
        scroll.setWidget(self.label)
        scroll.setWidgetResizable(True)
        scroll.setAlignment(Qt.AlignmentFlag.AlignCenter)
        layout.addWidget(scroll, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        if image.isNull():
            self.label.setText("This image cannot be displayed.")
            return
        screen = (parent.screen() if parent is not None else None) or QGuiApplication.primaryScreen()
        room = screen.availableGeometry().size() * 0.85 if screen is not None else QSize(1200, 900)
        pixmap = QPixmap.fromImage(image)
        if pixmap.width() > room.width() or pixmap.height() > room.height():
            pixmap = pixmap.scaled(
                room, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation
            )
        self.label.setPixmap(pixmap)
        self.resize(pixmap.width() + 40, pixmap.height() + 80)
