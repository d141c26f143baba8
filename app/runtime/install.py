"""Installing a runtime: download every wheel of a lock, verify, unpack, switch over last.

Layout under ``<data dir>/runtime/`` (``root``)::

    downloads/<runtime>/<wheel>.part   a download in progress (kept across cancels and restarts)
    downloads/<runtime>/<wheel>        a download whose SHA-256 matched the lock
    .staging-<runtime>/                being unpacked; never used
    <runtime>/site-packages/           the installed runtime (renamed from staging when complete)
    <runtime>/runtime.json             its record (:mod:`app.runtime.activate` checks it)
    current                            the runtime in use; written last, atomically

The order makes every interruption safe: until ``current`` names the new folder, the next start
uses what it used before (the CPU build, or the previous runtime). Downloads use
``engine.hub.transfer.fetch_file``, the download manager's transfer: HTTP Range resume from the
``.part`` file, SHA-256 while streaming, retries with backoff that a cancel interrupts.

No Qt here: :class:`RuntimeInstaller` runs on any thread and reports through a callback.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from app.runtime.activate import CANDIDATE_ENV, CURRENT, ENABLE_ENV, RECORD, SITE, read_current
from app.runtime.lock import LockedWheel, RuntimeLock
from engine.hub.client import RepoFile
from engine.hub.errors import InsufficientSpaceError, VerificationError
from engine.hub.retry import RetryPolicy
from engine.hub.transfer import SimpleControl, StopRequested, fetch_file
from engine.units import format_bytes

log = logging.getLogger(__name__)

# Unpacked size where a lock did not measure it: CUDA wheels are compressed libraries; torch's
# CPU wheel unpacks to ~4x, the CUDA library wheels to ~1.5-2x. 3x errs on the safe side.
UNPACK_FACTOR = 3
SPACE_MARGIN = 256 << 20  # slack for the file system and the records
PROGRESS_INTERVAL = 0.1  # seconds between progress reports (the last one always comes)


class InstallCancelled(Exception):
    """The user cancelled; what was downloaded stays for the next attempt."""


class RuntimeInstallError(RuntimeError):
    """The runtime could not be installed; the message says why and what to do."""


@dataclass(frozen=True)
class InstallProgress:
    stage: str  # "download", "unpack", "check" or "done"
    done: int  # bytes of this stage
    total: int
    speed: float = 0.0  # bytes/s over the last seconds (downloads only)
    eta: float | None = None  # seconds left (downloads only)
    current: str | None = None  # the wheel being worked on
    note: str | None = None  # e.g. a retry after a dropped connection


class SpeedMeter:
    """Bytes per second over a sliding window of recent samples."""

    def __init__(self, window: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, done: int) -> float:
        now = self.clock()
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window:
            self.samples.popleft()
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return max(0.0, (d1 - d0) / (t1 - t0)) if t1 - t0 > 0.2 else 0.0


Check = Callable[[Path], "str | None"]  # a runtime folder -> None if it works, else why not


def about_check(folder: Path, timeout: float = 300.0) -> str | None:
    """Start the app with the runtime in ``folder`` (``--about``, no window) and require "GPU
    found": a runtime that imports but cannot reach the GPU is not switched to."""
    command = (
        [sys.executable, "--about"]
        if getattr(sys, "frozen", False)
        else [sys.executable, "-m", "app", "--about"]
    )
    env = {**os.environ, CANDIDATE_ENV: str(folder), ENABLE_ENV: "1"}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the check could not start: {exc}"
    lines = result.stdout.splitlines()
    if result.returncode == 0 and any(line.startswith("GPU found:") for line in lines):
        return None
    said = next((line for line in lines if line.startswith(("Using the CPU", "Models cannot run"))), None)
    tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    return said or f"the app did not start with it (exit code {result.returncode}: {tail})"


def free_space(path: Path) -> int:
    """Free bytes on the volume that holds ``path`` (or its nearest existing parent)."""
    probe = Path(path).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


class RuntimeInstaller:
    """Installs one :class:`RuntimeLock` under ``root``; :meth:`cancel` from any thread."""

    def __init__(
        self,
        lock: RuntimeLock,
        root: Path,
        *,
        check: Check | None = about_check,
        retry: RetryPolicy | None = None,
        free_bytes: Callable[[Path], int] = free_space,
        clock: Callable[[], float] = time.monotonic,
        progress_interval: float = PROGRESS_INTERVAL,
    ) -> None:
        self.lock = lock
        self.progress_interval = progress_interval
        self.root = Path(root)
        self.check = check
        self.retry = retry or RetryPolicy()
        self.free_bytes = free_bytes
        self.clock = clock
        self.control = SimpleControl()
        self.downloads = self.root / "downloads" / lock.name
        self.staging = self.root / f".staging-{lock.name}"
        self.target = self.root / lock.name

    # -- sizes -------------------------------------------------------------------------------------

    def _have(self, wheel: LockedWheel) -> int:
        """Bytes of ``wheel`` already on disk (complete or partial)."""
        if (self.downloads / wheel.filename).is_file():
            return wheel.size
        try:
            return min(wheel.size, (self.downloads / f"{wheel.filename}.part").stat().st_size)
        except OSError:
            return 0

    def remaining_download(self) -> int:
        return sum(w.size - self._have(w) for w in self.lock.wheels)

    def unpacked_size(self) -> int:
        return sum(
            w.unpacked_size if w.unpacked_size is not None else UNPACK_FACTOR * w.size
            for w in self.lock.wheels
        )

    def space_needed(self) -> int:
        """Free space the install still needs: the rest of the download plus the unpacked runtime
        (the downloaded wheels are deleted only once everything is unpacked)."""
        return self.remaining_download() + self.unpacked_size() + SPACE_MARGIN

    def check_space(self) -> None:
        """Raise :class:`InsufficientSpaceError` naming the free and the needed space."""
        needed, free = self.space_needed(), self.free_bytes(self.root)
        if free < needed:
            raise InsufficientSpaceError(
                f"Not enough free disk space for the GPU runtime in {self.root}: "
                f"{format_bytes(free)} free, {format_bytes(needed)} needed. "
                "Free some space and try again (what was downloaded so far is kept).",
                needed,
                free,
            )

    def adopt_downloads(self, folder: Path) -> int:
        """Take wheels downloaded elsewhere (``folder`` holds files named as in the lock, e.g. from
        ``pip download``; for machines without a network): each whose SHA-256 matches the lock is
        copied in as downloaded. Returns the bytes taken."""
        taken = 0
        self.downloads.mkdir(parents=True, exist_ok=True)
        for wheel in self.lock.wheels:
            source = Path(folder) / wheel.filename
            if (self.downloads / wheel.filename).is_file() or not source.is_file():
                continue
            digest = hashlib.sha256()
            with open(source, "rb") as f:
                while block := f.read(8 << 20):
                    digest.update(block)
            if digest.hexdigest() != wheel.sha256:
                log.warning("%s does not match the lock's SHA-256; not used", source)
                continue
            part = self.downloads / f"{wheel.filename}.part"
            shutil.copyfile(source, part)
            os.replace(part, self.downloads / wheel.filename)
            taken += wheel.size
        return taken

    # -- the install -------------------------------------------------------------------------------

    def cancel(self) -> None:
        self.control.request_stop("cancel")

    def install(self, on_progress: Callable[[InstallProgress], None] | None = None) -> Path:
        """Download, verify, unpack, check and switch to the runtime; returns its folder.

        Raises :class:`InstallCancelled`, :class:`InsufficientSpaceError`,
        :class:`RuntimeInstallError` or the download's errors (``engine.hub.errors``); none of
        them leaves a half-installed runtime in use.
        """
        report = on_progress or (lambda p: None)
        self.root.mkdir(parents=True, exist_ok=True)
        self.check_space()
        self._download_all(report)
        self._unpack_all(report)
        if self.check is not None:
            report(InstallProgress("check", 0, 1, note="starting Trellis Chat with the GPU runtime"))
            problem = self.check(self.staging)
            if problem is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
                raise RuntimeInstallError(
                    f"The GPU runtime was downloaded but does not work on this computer: {problem}. "
                    "Trellis Chat keeps using the CPU."
                )
        self._switch()
        shutil.rmtree(self.downloads, ignore_errors=True)
        report(InstallProgress("done", 1, 1))
        return self.target

    def _download_all(self, report: Callable[[InstallProgress], None]) -> None:
        total = self.lock.download_size
        finished = sum(w.size for w in self.lock.wheels if (self.downloads / w.filename).is_file())
        meter = SpeedMeter(clock=self.clock)
        last = {"time": 0.0, "done": finished}

        def progress(wheel: LockedWheel, file_done: int) -> None:
            done = last["done"] = finished + file_done
            speed = meter.add(done)
            now = self.clock()
            if now - last["time"] >= self.progress_interval or done == total:
                last["time"] = now
                eta = (total - done) / speed if speed > 0 else None
                report(InstallProgress("download", done, total, speed, eta, wheel.filename))

        def retrying(wheel: LockedWheel, attempt: int, delay: float, reason: str) -> None:
            # Said at once: the wait before the next attempt may be long, and sends no progress.
            note = f"{reason}; trying again in {delay:.0f} s (attempt {attempt + 1})"
            report(InstallProgress("download", last["done"], total, 0.0, None, wheel.filename, note))

        for wheel in self.lock.wheels:
            if (self.downloads / wheel.filename).is_file():
                continue
            self._fetch(
                wheel,
                lambda n, w=wheel: progress(w, n),
                lambda attempt, delay, reason, w=wheel: retrying(w, attempt, delay, reason),
            )
            finished += wheel.size

    def _fetch(
        self,
        wheel: LockedWheel,
        progress: Callable[[int], None],
        retrying: Callable[[int, float, str], None],
    ) -> None:
        part = self.downloads / f"{wheel.filename}.part"
        file = RepoFile(path=wheel.filename, size=wheel.size, sha256=wheel.sha256)
        for attempt in (1, 2):
            try:
                fetch_file(
                    wheel.url,
                    file,
                    part,
                    headers={},
                    control=self.control,
                    on_progress=progress,
                    on_retry=retrying,
                    retry=self.retry,
                )
            except StopRequested:
                raise InstallCancelled("cancelled; the download resumes where it stopped") from None
            except VerificationError as exc:
                # Corrupt bytes cannot be resumed from: start this wheel over, once.
                part.unlink(missing_ok=True)
                if attempt == 2:
                    raise RuntimeInstallError(
                        f"{wheel.filename} does not match the SHA-256 of the lock file twice in a row "
                        f"({exc}); the download source may be damaged. Try again later."
                    ) from exc
                log.warning("%s failed verification; downloading it again", wheel.filename)
                continue
            os.replace(part, self.downloads / wheel.filename)
            return

    def _unpack_all(self, report: Callable[[InstallProgress], None]) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        site = self.staging / SITE
        site.mkdir(parents=True)
        total = self.lock.download_size
        done = 0
        for wheel in self.lock.wheels:
            if self.control.stop_reason() is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
                raise InstallCancelled("cancelled while unpacking; the downloads are kept")
            report(InstallProgress("unpack", done, total, current=wheel.filename))
            try:
                unpack_wheel(self.downloads / wheel.filename, site)
            except (OSError, zipfile.BadZipFile, ValueError) as exc:
                shutil.rmtree(self.staging, ignore_errors=True)
                raise RuntimeInstallError(f"unpacking {wheel.filename} failed: {exc}") from exc
            done += wheel.size
        report(InstallProgress("unpack", total, total))
        record = {
            "name": self.lock.name,
            "variant": self.lock.variant,
            "torch": self.lock.torch,
            "cuda": self.lock.cuda,
            "python": self.lock.python,
            "platform": self.lock.platform,
            "wheels": [w.filename for w in self.lock.wheels],
            "complete": True,
        }
        _write_atomic(self.staging / RECORD, json.dumps(record, indent=2))

    def _switch(self) -> None:
        """Move the checked staging folder into place, then name it in ``current``."""
        if self.target.exists():
            # Reinstalling the runtime in use: stop naming it first, so a crash in between
            # leaves the CPU build in use rather than a half-removed runtime.
            if read_current(self.root) == self.lock.name:
                (self.root / CURRENT).unlink(missing_ok=True)
            shutil.rmtree(self.target)
        os.replace(self.staging, self.target)
        _write_atomic(self.root / CURRENT, self.lock.name + "\n")


def unpack_wheel(archive: Path, site: Path) -> None:
    """Unpack a wheel (or a zip of extension binaries) into ``site``: ``*.data/purelib`` and
    ``platlib`` land in ``site`` like the rest; scripts, headers and data are not needed; paths
    that would leave ``site`` are refused; executable bits are kept (triton runs its ``ptxas``)."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            parts = PurePosixPath(info.filename).parts
            if not parts or info.filename.startswith("/") or ".." in parts or "\\" in info.filename:
                raise ValueError(f"unsafe path in {archive.name}: {info.filename!r}")
            if parts[0].endswith(".data") and len(parts) > 1:
                if parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
                if not parts:
                    continue
            dest = site.joinpath(*parts)
            if info.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            if mode & stat.S_IXUSR:
                dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def installed_runtime(root: Path) -> Path | None:
    """The runtime folder ``current`` names, if any (whether it works is :mod:`activate`'s call)."""
    name = read_current(root)
    return Path(root) / name if name else None


def remove_runtime(root: Path) -> None:
    """Stop using the installed runtime and delete it with any downloads (the next start uses
    the bundled CPU build)."""
    root = Path(root)
    (root / CURRENT).unlink(missing_ok=True)
    if root.is_dir():
        shutil.rmtree(root)
