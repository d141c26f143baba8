"""Turning a name that came from outside into a path inside a folder, or refusing it.

Names from a Hub file listing, a model's shard index or a repository id are data chosen by someone
else (a repository author, or whatever server ``HF_ENDPOINT`` points at). Joined to a folder as they
are, ``../../x`` or ``/home/u/.bashrc`` lead out of it. ``safe_join`` is the one function that makes
such paths: it accepts only a plain relative POSIX path and checks, on resolved paths, that the
result stays inside the folder (so a symlink already inside it cannot lead out either).

No imports beyond the standard library and ``engine.errors``: the Hub code, the loaders and the app
all use it, and none of them should pay for the others' dependencies.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from engine.errors import EngineError

__all__ = ["UnsafePathError", "path_problem", "safe_join"]


class UnsafePathError(EngineError):
    """A name from outside is not a plain relative path, or would lead out of its folder."""

    def __init__(self, message: str, name: object = None) -> None:
        super().__init__(message)
        self.name = name


def path_problem(name: object) -> str | None:
    """Why ``name`` is not an acceptable repository-relative POSIX path; None when it is.

    Rules are the same on every platform, so a repository downloads to the same files everywhere
    (and a name that is harmless on Linux but means something else on Windows is refused on Linux
    too).
    """
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    # Cc covers NUL, newlines, escapes and the C1 range: none belongs in a file name, and NUL
    # truncates the name in the C library calls underneath.
    if any(unicodedata.category(ch) == "Cc" for ch in name):
        return "contains a control character"
    if "\\" in name:
        return "contains a backslash (a Windows path separator)"
    # "C:x" is drive-relative on Windows and "a.bin:s" writes an alternate data stream of a.bin.
    if ":" in name:
        return "contains a colon (a drive letter or a Windows data stream)"
    if name.startswith("/"):
        return "is an absolute path"
    for part in name.split("/"):
        if part == "":
            return "has an empty path component"
        if part in (".", ".."):
            return f"has a '{part}' path component"
    return None


def safe_join(
    root: str | Path,
    name: str,
    *,
    suffix: str = "",
    error: type[UnsafePathError] = UnsafePathError,
    resolve: bool = True,
) -> Path:
    """``root / name`` (+ ``suffix`` on the last component), refused unless it stays inside ``root``.

    Raises ``error`` (an ``UnsafePathError`` subclass, so callers can raise their own typed error)
    naming ``name`` when it breaks a rule of ``path_problem`` or, once symlinks are resolved,
    points outside ``root`` or at ``root`` itself. Returns the unresolved path under ``root``.

    ``resolve=False`` applies the name rules only (which already keep the path inside ``root``
    lexically): for *reading* names from a folder whose symlinks the user put there, e.g. a
    Hugging Face cache snapshot, where every file is a link into ``../../blobs``. Anything that
    writes keeps the default.
    """
    problem = path_problem(name)
    if problem is None and resolve:
        base = Path(root).resolve()
        parts = name.split("/")
        target = base.joinpath(*parts[:-1], parts[-1] + suffix)
        resolved = target.resolve()
        if resolved == base or not resolved.is_relative_to(base):
            problem = f"leads outside {base} (to {resolved})"
    if problem is not None:
        raise error(f"unsafe file path {name!r}: it {problem}", name)
    parts = name.split("/")
    return Path(root).joinpath(*parts[:-1], parts[-1] + suffix)
