"""Images in requests: a ``data:`` URL, or a path on the server's machine under a folder the
server was told it may read (``--allowed-media-dir``; by default none, so a client can never make
the server read its files). Web URLs are refused: the server fetches nothing."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from engine.serve.errors import APIError, bad_request

MAX_IMAGE_BYTES = 32 * 1024 * 1024  # a file read from disk; a data URL is bounded by the body limit


def read_image(url: str, allowed_dirs: Sequence[Path], param: str) -> bytes:
    """The encoded bytes of the image ``url`` names (decoding is the vision code's business)."""
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad_request("an image data URL must be base64: data:image/...;base64,...", param=param)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("the image data URL is not valid base64", param=param) from None
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise bad_request("the server does not fetch web URLs: send the image as a data URL", param=param)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
    elif parsed.scheme in ("", None) or len(parsed.scheme) == 1:  # a path (or a Windows drive)
        path = Path(url)
    else:
        raise bad_request(f"unsupported image URL scheme {parsed.scheme!r}", param=param)
    return _read_allowed(path, allowed_dirs, param)


def _read_allowed(path: Path, allowed_dirs: Sequence[Path], param: str) -> bytes:
    if not allowed_dirs:
        raise bad_request(
            "image paths are not allowed on this server (start it with --allowed-media-dir DIR), "
            "send the image as a data URL",
            param=param,
        )
    try:
        real = path.expanduser().resolve(strict=True)  # symlinks followed: the real file decides
    except OSError:
        raise bad_request(f"image {path} does not exist", param=param) from None
    if not any(real.is_relative_to(root) for root in allowed_dirs):
        raise APIError(
            403,
            f"image {path} is outside the folders this server may read",
            param=param,
            code="path_not_allowed",
        )
    if not real.is_file():
        raise bad_request(f"image {path} is not a file", param=param)
    if real.stat().st_size > MAX_IMAGE_BYTES:
        raise bad_request(f"image {path} is larger than {MAX_IMAGE_BYTES // 2**20} MiB", param=param)
    return real.read_bytes()


def resolve_dirs(dirs: Sequence[str | Path]) -> list[Path]:
    """The allowed folders, resolved once (a path is compared with them after resolving too)."""
    return [Path(d).expanduser().resolve() for d in dirs]
