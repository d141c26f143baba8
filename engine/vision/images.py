"""Reading images users attach: clear errors for what cannot be shown to a model, and a content
hash that names an image by its pixels (the same picture sent twice is encoded once and its
cached pages are reused)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from engine.errors import EngineError

# Larger images are refused before decoding: a 20k x 20k PNG is 1.2 GB of RGB, and every model
# downsizes to at most a few megapixels anyway.
MAX_PIXELS = 16384 * 16384


class ImageInputError(EngineError):
    """An attached image cannot be read or is unusable (corrupt, empty, huge, unknown format)."""


ImageSource = str | Path | bytes | Image.Image


def load_image(source: ImageSource) -> Image.Image:
    """An RGB-convertible, fully decoded PIL image from a path, encoded bytes or a PIL image."""
    name = "image"
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (str, Path)):
            name = str(source)
            try:
                data = Path(source).read_bytes()
            except OSError as exc:
                raise ImageInputError(f"cannot read image {name}: {exc.strerror or exc}") from None
        else:
            data = bytes(source)
        if not data:
            raise ImageInputError(f"{name} is empty")
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ImageInputError(f"{name} is not an image in a format this engine can read") from None
        except Exception as exc:  # Pillow raises assorted errors for broken headers
            raise ImageInputError(f"{name} cannot be decoded: {exc}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageInputError(f"{name} has no pixels ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise ImageInputError(f"{name} is too large ({width}x{height}); the limit is {MAX_PIXELS} pixels")
    try:
        image.load()
    except Exception as exc:  # truncated or corrupt pixel data
        raise ImageInputError(f"{name} is corrupt: {exc}") from None
    return image


def content_hash(image: Image.Image) -> str:
    """A hex digest of the image's decoded pixels, size and mode (not of the file's bytes: the
    same picture re-encoded is the same image to the model)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()
