"""What a SQLite error means for the user: damaged file, busy database, full disk, or something else.

The store raises ``sqlite3`` exceptions as they come; the GUI needs to know which of them a retry
can fix (a lock is released, space is freed) and which need a repair (a damaged file), and it needs
one plain sentence for each. Python 3.11+ exposes SQLite's own error code on the exception, which is
more reliable than the message text (that one is used only as a fallback).
"""

from __future__ import annotations

import sqlite3
from enum import Enum

# SQLite primary result codes (the low byte of an extended code).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_NOMEM = 7
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26


class StorageProblem(Enum):
    DAMAGED = "damaged"  # the file is corrupt: only a repair (restart) helps
    BUSY = "busy"  # another connection holds the write lock: retry later
    FULL = "full"  # no space left: retry once space is freed
    READ_ONLY = "read_only"  # the file or its folder cannot be written
    OTHER = "other"  # I/O errors and the rest: retry, but say what SQLite said


def _code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def classify(exc: BaseException) -> StorageProblem:
    """Which kind of storage problem ``exc`` (an ``sqlite3.Error``) is."""
    code = _code(exc)
    text = str(exc).lower()
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in text or "not a database" in text:
        return StorageProblem.DAMAGED
    if code in (_SQLITE_BUSY, _SQLITE_LOCKED) or "locked" in text or "busy" in text:
        return StorageProblem.BUSY
    if code == _SQLITE_FULL or "disk is full" in text or "no space" in text:
        return StorageProblem.FULL
    if code in (_SQLITE_READONLY, _SQLITE_CANTOPEN) or "readonly" in text or "read-only" in text:
        return StorageProblem.READ_ONLY
    return StorageProblem.OTHER


def is_corruption(exc: BaseException) -> bool:
    """A damaged database file (``database disk image is malformed``, ``file is not a database``).
    ``OperationalError`` (locks, full disk) is a subclass of ``DatabaseError`` too, so the type
    alone does not tell."""
    return isinstance(exc, sqlite3.DatabaseError) and classify(exc) is StorageProblem.DAMAGED


def describe(exc: BaseException, doing: str = "save the conversation", will_retry: bool = True) -> str:
    """One or two plain sentences for the chat's error line: what went wrong while trying to
    ``doing``, and what happens now (``will_retry``: the text is kept and saved later) or what the
    user can do about it."""
    problem = classify(exc)
    if problem is StorageProblem.DAMAGED:
        kept = " Until then it stays on screen." if will_retry else ""
        return (
            f"Could not {doing}: the conversation database is damaged ({exc}). Restart Trellis Chat "
            "to repair it: the damaged file is kept aside and your conversations are restored from "
            f"the latest backup plus whatever can still be read.{kept}"
        )
    cause = {
        StorageProblem.BUSY: "another program is writing to the conversation database",
        StorageProblem.FULL: "the disk is full",
        StorageProblem.READ_ONLY: f"the data folder cannot be written ({exc})",
    }.get(problem, f"the database reported an error ({exc})")
    if will_retry:
        when = {
            StorageProblem.BUSY: "as soon as the database is free",
            StorageProblem.FULL: "once some space is freed",
            StorageProblem.READ_ONLY: "once the folder is writable",
        }.get(problem, "when it works again; Trellis Chat keeps trying")
        return f"Saving delayed: could not {doing} because {cause}. It stays on screen and is saved {when}."
    advice = {
        StorageProblem.BUSY: "Try again in a moment.",
        StorageProblem.FULL: "Free some space and try again.",
        StorageProblem.READ_ONLY: "Make the folder writable, or start Trellis Chat with --data-dir "
        "pointing to a folder that is.",
    }.get(problem, "Try again later.")
    return f"Could not {doing}: {cause}. {advice}"


def retryable(exc: BaseException) -> bool:
    """Whether waiting can fix it (a damaged file needs a restart and a repair instead)."""
    return classify(exc) is not StorageProblem.DAMAGED
