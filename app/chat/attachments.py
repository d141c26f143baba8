"""Images a user attaches to the message being written: reading them, and the pending list.

Three ways in, one path: the Attach button gives file paths, a drop gives file URLs or image
data, a paste gives clipboard image data (or copied files). ``sources_from_mime`` turns mime data
into file paths and ``QImage``s, and ``read_image`` turns either into an ``ImageBlob`` (the
encoded bytes plus format and size) or a sentence saying why it cannot be attached.

A file is kept as its own bytes (not re-encoded), so its sha256 names it: attaching the same
file twice, in one message or many, stores it once. Clipboard images have no file; they are
encoded as PNG (lossless).

Validation uses Pillow's header reader, the same library the engine decodes with, so an image
the engine could not read is refused here, at attach time, rather than when the reply starts.
Only the header is read (cheap on the GUI thread); the thumbnail decode catches corrupt pixels.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from PySide6.QtCore import (
    QAbstractListModel,
    QBuffer,
    QByteArray,
    QIODevice,
    QMimeData,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    Qt,
)
from PySide6.QtGui import QImage, QPixmap

from app.chat.images import THUMBNAIL_SIZE, thumbnail_pixmap
from app.gui_thread import require_gui_thread
from app.store import ImageBlob
from engine.units import format_bytes

# The engine refuses larger images before decoding (engine.vision.images.MAX_PIXELS); every
# model downsizes to a few megapixels anyway.
MAX_PIXELS = 16384 * 16384
# Bytes: a conversation lives in one SQLite file; a 100 MB TIFF there helps nobody.
MAX_BYTES = 64 * 1024 * 1024
LIMIT = format_bytes(MAX_BYTES, decimals=0)  # "64 MiB", as the refusals say it
# What the Attach dialog offers (what Pillow reads and people actually have).
FILE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp *.tif *.tiff);;All files (*)"

ImageSource = str | Path | QImage


class AttachmentError(ValueError):
    """An image cannot be attached; the message says why, in words for the user."""


def read_image(source: ImageSource) -> ImageBlob:
    """An attachable image from a file path or a ``QImage`` (pasted or dropped image data)."""
    if isinstance(source, QImage):
        return _from_qimage(source)
    path = Path(source)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise AttachmentError(
                f"{path.name} is too large to attach ({format_bytes(size)}; the limit is {LIMIT})"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise AttachmentError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    return image_from_bytes(data, path.name)


def image_from_bytes(data: bytes, name: str = "the image") -> ImageBlob:
    """Check encoded image bytes the way the engine will read them; raise AttachmentError."""
    if not data:
        raise AttachmentError(f"{name} is empty")
    if len(data) > MAX_BYTES:
        raise AttachmentError(f"{name} is too large to attach (the limit is {LIMIT})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                fmt, (width, height) = image.format, image.size
    except UnidentifiedImageError:
        raise AttachmentError(f"{name} is not an image in a format the engine can read") from None
    except Image.DecompressionBombError:
        raise AttachmentError(f"{name} has too many pixels to attach") from None
    except Exception as exc:  # Pillow raises assorted errors for damaged headers
        raise AttachmentError(f"{name} cannot be read as an image ({exc})") from None
    if width <= 0 or height <= 0:
        raise AttachmentError(f"{name} has no pixels ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise AttachmentError(f"{name} is too large ({width}x{height} pixels)")
    mime = Image.MIME.get(fmt or "", "application/octet-stream")
    return ImageBlob(data, mime, width, height)


def _from_qimage(image: QImage) -> ImageBlob:
    if image.isNull():
        raise AttachmentError("the pasted image is empty")
    buffer = QByteArray()
    device = QBuffer(buffer)
    device.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(device, "PNG"):
        raise AttachmentError("the pasted image could not be encoded")
    device.close()
    return image_from_bytes(bytes(buffer.data()), "the pasted image")


def sources_from_mime(mime: QMimeData | None) -> list[ImageSource]:
    """What in ``mime`` could be an image: local files (any: ``read_image`` decides) and image
    data. Empty when it holds only text, which then goes into the composer as text."""
    if mime is None:
        return []
    files = [url.toLocalFile() for url in mime.urls() if url.isLocalFile()] if mime.hasUrls() else []
    if files:
        return list(files)
    if mime.hasImage():
        data = mime.imageData()
        image = data if isinstance(data, QImage) else QImage(data) if data is not None else QImage()
        if not image.isNull():
            return [image]
    return []


class AttachmentListModel(QAbstractListModel):
    """The images attached to the message being written (GUI thread only).

    Rows hold ``ImageBlob``s; DecorationRole is a thumbnail, ToolTipRole a description.
    """

    BLOB_ROLE = Qt.ItemDataRole.UserRole + 1

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._blobs: list[ImageBlob] = []
        self._thumbnails: dict[str, QPixmap] = {}

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._blobs)

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._blobs):
            return None
        blob = self._blobs[index.row()]
        if role == self.BLOB_ROLE:
            return blob
        if role == Qt.ItemDataRole.DecorationRole:
            pixmap = self._thumbnails.get(blob.sha256)
            if pixmap is None:
                pixmap = self._thumbnails[blob.sha256] = thumbnail_pixmap(blob.data, THUMBNAIL_SIZE)
            return pixmap
        if role in (Qt.ItemDataRole.ToolTipRole, Qt.ItemDataRole.DisplayRole):
            return describe(blob)
        return None

    def blobs(self) -> list[ImageBlob]:
        return list(self._blobs)

    def add(self, blob: ImageBlob) -> None:
        require_gui_thread("AttachmentListModel")
        row = len(self._blobs)
        self.beginInsertRows(QModelIndex(), row, row)
        self._blobs.append(blob)
        self.endInsertRows()

    def remove(self, row: int) -> None:
        require_gui_thread("AttachmentListModel")
        if 0 <= row < len(self._blobs):
            self.beginRemoveRows(QModelIndex(), row, row)
            del self._blobs[row]
            self.endRemoveRows()

    def clear(self) -> None:
        require_gui_thread("AttachmentListModel")
        self.beginResetModel()
        self._blobs = []
        self._thumbnails = {}
        self.endResetModel()


def describe(blob: ImageBlob) -> str:
    kind = blob.mime.split("/")[-1].upper()
    return f"{kind} image, {blob.width}×{blob.height}, {format_bytes(len(blob.data))}"
