"""One file from a URL into a resumable ``.part`` file, hashed while it streams, retried with backoff.

This is the piece ``huggingface_hub.hf_hub_download`` cannot be used for (see the findings in
``engine.hub.downloads``): it must keep its partial file across process restarts, stop at the next
chunk when the user pauses or cancels, wait between retries in a way a pause can interrupt, and
verify the content hash. What it still takes from ``huggingface_hub``: the shared HTTP client
(``get_session()``: proxies, user agent, request ids, offline mode), the headers
(``build_hf_headers``), the URL (``hf_hub_url``) and the typed errors (``hf_raise_for_status``).

Memory: one network read (at most 64 KiB with httpx, or ``chunk_size``) is held at a time; files are
never held whole. Chunks are written as they arrive, so a dropped connection loses no received byte.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx2
from huggingface_hub.utils import get_session, hf_raise_for_status

from engine.hub.client import RepoFile
from engine.hub.errors import DiskFullError, DownloadError, VerificationError
from engine.hub.retry import RetryPolicy, is_retryable, retry_after_seconds, status_of

log = logging.getLogger(__name__)

READ_BLOCK = 8 << 20


class StopRequested(Exception):
    """Raised inside a transfer when the job was asked to pause or cancel."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Control(Protocol):
    """How a transfer learns that it should stop, and how it sleeps between retries."""

    def stop_reason(self) -> str | None: ...

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; False when woken early because a stop was requested."""
        ...


class FileHasher:
    """The hash the Hub lists for a file: sha256 for LFS files, else the git blob sha1."""

    def __init__(self, file: RepoFile) -> None:
        self.file = file
        self.reset()

    def reset(self) -> None:
        if self.file.sha256:
            self.kind = "sha256"
            self._h = hashlib.sha256()
        elif self.file.blob_id:
            self.kind = "git-sha1"
            # git hashes "blob <size>\0" + content; the size is known from the plan.
            self._h = hashlib.sha1(f"blob {self.file.size}\0".encode())
        else:
            self.kind = "none"
            self._h = None

    def update(self, data: bytes | memoryview) -> None:
        if self._h is not None:
            self._h.update(data)

    @property
    def expected(self) -> str | None:
        return self.file.sha256 or self.file.blob_id

    def check(self) -> str:
        """Raise VerificationError unless the digest matches; returns the digest."""
        if self._h is None:
            raise VerificationError(
                f"{self.file.path}: the Hub lists no hash for this file; cannot verify it"
            )
        digest = self._h.hexdigest()
        if digest != self.expected:
            raise VerificationError(
                f"{self.file.path}: {self.kind} mismatch (expected {self.expected}, got {digest}); "
                "the downloaded data is corrupt"
            )
        return digest


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def fetch_file(
    url: str,
    file: RepoFile,
    part_path: Path,
    *,
    headers: dict[str, str],
    control: Control,
    on_progress: Callable[[int], None] | None = None,
    on_retry: Callable[[int, float, str], None] | None = None,
    retry: RetryPolicy | None = None,
    chunk_size: int | None = None,
    stall_timeout: float = 30.0,
    connect_timeout: float = 15.0,
) -> str:
    """Download ``url`` into ``part_path`` (resuming what is there), verify it, return its digest.

    ``on_progress(done)`` gets the absolute byte count of this file; ``on_retry(attempt, delay,
    reason)`` is told before each backoff wait. Raises ``StopRequested`` on pause/cancel (the part
    file stays), ``VerificationError`` on a hash mismatch, ``DiskFullError`` when the disk fills,
    huggingface_hub's typed errors for 401/403/404, and ``DownloadError`` after too many
    consecutive failed attempts.
    """
    retry = retry or RetryPolicy()
    part_path.parent.mkdir(parents=True, exist_ok=True)
    hasher = FileHasher(file)
    size = file.size
    progress = on_progress or (lambda done: None)

    offset = _rehash_existing(part_path, size, hasher, control)
    progress(offset)
    failures = 0
    timeout = httpx2.Timeout(
        connect=connect_timeout, read=stall_timeout, write=stall_timeout, pool=connect_timeout
    )
    session = get_session()
    if size == 0:
        part_path.touch()
        return hasher.check()
    while offset < size:
        if (reason := control.stop_reason()) is not None:
            raise StopRequested(reason)
        req_headers = dict(headers)
        req_headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file itself
        if offset > 0:
            req_headers["Range"] = f"bytes={offset}-"
        made_progress = False
        try:
            with session.stream("GET", url, headers=req_headers, timeout=timeout, follow_redirects=True) as r:
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                if offset > 0 and r.status_code == 200:
                    # The server ignored Range and sends the whole file: start over rather than
                    # append the beginning of the file after its middle.
                    log.info("%s: server ignored Range, restarting from 0", file.path)
                    offset = 0
                    hasher.reset()
                    _truncate(part_path, 0)
                    progress(0)
                elif r.status_code == 206:
                    m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
                    if not m or int(m.group(1)) != offset:
                        raise DownloadError(
                            f"{file.path}: server answered a range other than the one asked for "
                            f"({r.headers.get('Content-Range')!r} for bytes={offset}-)"
                        )
                with open(part_path, "ab") as out:
                    for chunk in r.iter_bytes(chunk_size):
                        if not chunk:
                            continue
                        if offset + len(chunk) > size:
                            raise VerificationError(
                                f"{file.path}: server sent more than the {size} bytes the Hub lists"
                            )
                        _write(out, chunk, part_path)
                        hasher.update(chunk)
                        offset += len(chunk)
                        made_progress = True
                        progress(offset)
                        if (reason := control.stop_reason()) is not None:
                            out.flush()
                            raise StopRequested(reason)
                    out.flush()
                    os.fsync(out.fileno())
                if offset < size:
                    # The body ended early without a transport error (a proxy closing cleanly).
                    raise httpx2.RemoteProtocolError(f"body ended at {offset} of {size} bytes")
        except (StopRequested, VerificationError, DiskFullError, DownloadError):
            raise
        except Exception as exc:
            if status_of(exc) == 416:
                # Our offset is past what the server has: the part file is not this file.
                _truncate(part_path, 0)
                offset = 0
                hasher.reset()
                progress(0)
            elif not is_retryable(exc):
                raise
            failures = 0 if made_progress else failures + 1
            if failures >= retry.max_attempts:
                raise DownloadError(
                    f"{file.path}: giving up after {failures} failed attempts in a row "
                    f"({_describe(exc)}); the {offset} bytes received are kept for resume"
                ) from exc
            delay = retry.delay(max(1, failures), retry_after_seconds(exc))
            log.info("%s: %s; retry %d in %.1fs", file.path, _describe(exc), failures, delay)
            if on_retry is not None:
                on_retry(failures, delay, _describe(exc))
            if not control.wait(delay):
                raise StopRequested(control.stop_reason() or "pause") from None
    return hasher.check()


def _rehash_existing(part_path: Path, size: int, hasher: FileHasher, control: Control) -> int:
    """Feed the bytes already on disk to the hasher; returns the offset to resume from."""
    try:
        have = part_path.stat().st_size
    except FileNotFoundError:
        return 0
    if have > size:
        _truncate(part_path, 0)
        return 0
    done = 0
    with open(part_path, "rb") as f:
        while done < have:
            if (reason := control.stop_reason()) is not None:
                raise StopRequested(reason)
            block = f.read(min(READ_BLOCK, have - done))
            if not block:
                break
            hasher.update(block)
            done += len(block)
    return done


def _truncate(path: Path, length: int) -> None:
    with open(path, "ab") as f:
        f.truncate(length)


def _write(out, chunk: bytes, part_path: Path) -> None:
    try:
        out.write(chunk)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"the disk holding {part_path.parent} is full; free some space and resume "
                "(the bytes received so far are kept)"
            ) from exc
        raise


def _describe(exc: BaseException) -> str:
    status = status_of(exc)
    if status is not None:
        return f"HTTP {status}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class SimpleControl:
    """A Control backed by a threading.Event: ``request_stop('pause'|'cancel')`` from any thread."""

    def __init__(self) -> None:
        import threading

        self._event = threading.Event()
        self._reason: str | None = None

    def request_stop(self, reason: str) -> None:
        self._reason = reason
        self._event.set()

    def clear(self) -> None:
        self._reason = None
        self._event.clear()

    def stop_reason(self) -> str | None:
        return self._reason

    def wait(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return self._reason is None
            if self._event.wait(left):
                return False
