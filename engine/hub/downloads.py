"""The download manager: a persistent queue of model downloads that resume, retry and verify.

What ``huggingface_hub`` (2.4.0, read from its source and checked against the test server in
``tests/hub/test_hf_hub_findings.py``) does and does not do for a download, and so what is written here:

* **Verification.** ``hf_hub_download`` checks only the byte count (``http_get`` raises "Consistency
  check failed" when the size differs). It never hashes the content against the LFS sha256 / ETag
  after a download (it hashes an existing file only in ``local_dir`` mode, to decide whether it can
  skip a download). Corrupted bytes of the right length are accepted. -> We hash while streaming:
  sha256 for LFS files, the git blob sha1 for the others, and refuse to finish on a mismatch.
* **Partial files.** ``_download_to_tmp_and_move`` writes to a process-unique
  ``<etag>.<uuid>.incomplete`` and deletes it in a ``finally`` on any error. A killed process leaves
  that file orphaned and the next process, choosing a new name, starts again from byte 0: no resume
  across restarts or after a failed call. -> ``.part`` files under ``<model>/.trellis-partial/`` that
  survive anything and are resumed with a ``Range`` request (after re-hashing what is on disk).
* **Retries.** Inside one ``http_get`` call, ``ConnectError``/``TimeoutException``/
  ``RemoteProtocolError`` are retried 5 times (the count resets when bytes arrive) with a fixed 1 s
  sleep, resuming with ``Range`` from the last *complete* 10 MiB chunk (``DOWNLOAD_CHUNK_SIZE``):
  bytes of a chunk in flight when the connection drops are discarded, so a link that drops more
  often than every 10 MiB never progresses. A 200 answer to a ``Range`` request is truncated. The
  file GET retries only HTTP 408/429 (``retry_on_status_codes=(408, 429)``), not 5xx; the metadata
  HEAD is not retried (``retry_on_errors=False``). ``http_backoff`` (used by ``list_models``) retries
  408/429/5xx and network errors 5 times, 1->8 s exponential, honouring ``Retry-After``; its waits are
  ``time.sleep`` that nothing can interrupt. ``model_info`` and ``list_repo_refs`` are not retried.
  -> One policy (``engine.hub.retry.RetryPolicy``) for all of them: exponential backoff with jitter,
  ``Retry-After`` honoured, consecutive-failure count reset by progress, waits a pause/cancel ends.
* **Stalls.** The shared client from ``get_session()`` has ``timeout=None``; file GETs pass
  ``HF_HUB_DOWNLOAD_TIMEOUT`` (10 s) but ``model_info`` defaults to no timeout and ``list_repo_refs``
  has none. -> Our transfers use a read timeout (``stall_timeout``) and metadata calls pass one.
* **Disk space.** ``_check_disk_space`` only emits a ``warnings.warn``. -> We refuse to start, naming
  the bytes required and free, and turn ``ENOSPC`` during a write into a clear error (data kept).
* **Control.** No queue, no concurrency limit across calls, no pause/cancel (only by raising out of a
  ``tqdm_class`` callback), progress only through tqdm. -> This module.
* **Tokens and endpoint.** ``get_token()`` reads ``HF_TOKEN`` then its token file; no keyring.
  ``constants.ENDPOINT`` is fixed from ``HF_ENDPOINT`` at import; functions accept ``endpoint=``.
  -> ``engine.hub.auth`` (keyring, masked ``Secret``) and ``engine.hub.client.current_endpoint``.
* **Telemetry.** Unless ``HF_HUB_DISABLE_TELEMETRY`` is set, building request headers fetches
  ``<import-time ENDPOINT>/api/agent-harnesses`` once a day (3 s timeout): a request to
  huggingface.co even when a mirror is passed with ``endpoint=`` after import. Left as is (a product
  decision), noted here because it surprises mirror and offline users.
* **Xet.** With ``hf_xet`` installed and a Xet-backed file, ``hf_hub_download`` uses Xet's chunk
  protocol. We use the plain ``resolve`` URL (the Hub bridges Xet storage to HTTP with ``Range``),
  giving up Xet's deduplication in exchange for resumable, verifiable transfers.

What is used from ``huggingface_hub``: ``HfApi.list_models`` / ``model_info(files_metadata=True)`` /
``list_repo_refs``, ``hf_hub_url``, ``build_hf_headers``, ``get_session`` (the shared httpx client,
redirects, proxies, offline mode), ``hf_raise_for_status`` and its typed errors, ``get_token``.

Threads: each running job has its own thread (at most ``max_concurrent``). Listeners registered with
``add_listener`` are called **from those threads** (and from the caller of a method); a GUI must
marshal them to its own thread (``app.downloads.qt_manager`` does, with a queued signal).

Persistence: the queue (ids, repos, revisions, destinations, states) is a JSON file written
atomically on every state change; each download's plan (pinned commit, files, hashes, which files
are verified) lives next to its data in ``<model>/.trellis-partial/plan.json``. After a kill or a
reboot, a new manager on the same state file re-queues what was running and resumes from the
``.part`` files. The CLI uses no state file: re-running the same command resumes from the plan.
"""

from __future__ import annotations

import collections
import fnmatch
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Literal

from engine.hub.client import HubClient, RepoFile, translate_error
from engine.hub.errors import (
    DownloadError,
    GatedRepoError,
    HubError,
    InsufficientSpaceError,
    UnsafeRepoPathError,
    VerificationError,
)
from engine.hub.library import (
    COMPLETE_MARKER,
    PARTIAL_DIR,
    PARTS_DIR,
    PLAN_FILE,
    atomic_write_json,
    default_models_dir,
    fsync_dir,
    model_dir_name,
    read_json,
    read_marker,
)
from engine.hub.retry import RetryPolicy
from engine.hub.transfer import SimpleControl, StopRequested, fetch_file
from engine.safe_paths import UnsafePathError, safe_join
from engine.units import format_bytes

log = logging.getLogger(__name__)

STATE_VERSION = 1


class JobState(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"  # resolving the revision to a commit, listing files, checking space
    DOWNLOADING = "downloading"
    FINALIZING = "finalizing"  # all files verified: moving them in place, writing the marker
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


RUNNING_STATES = frozenset({JobState.STARTING, JobState.DOWNLOADING, JobState.FINALIZING})
TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


@dataclass(frozen=True)
class FileStatus:
    path: str
    size: int
    done: int
    verified: bool


@dataclass(frozen=True)
class JobSnapshot:
    """An immutable view of one download, safe to hand to another thread."""

    id: str
    repo_id: str
    revision: str
    dest: Path
    state: JobState
    error: str | None = None
    commit: str | None = None
    files: tuple[FileStatus, ...] = ()
    done_bytes: int = 0
    total_bytes: int = 0
    speed: float = 0.0  # bytes/s over the last few seconds
    eta: float | None = None  # seconds
    current_file: str | None = None
    note: str | None = None  # e.g. "retry 2 in 4 s (HTTP 503)"
    created: float = 0.0

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True)
class DownloadEvent:
    kind: Literal["added", "changed", "progress", "removed"]
    job: JobSnapshot


Listener = Callable[[DownloadEvent], None]


def disk_free(path: Path) -> int:
    """Free bytes on the volume that holds ``path`` (its nearest existing ancestor). Tests patch this."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


@dataclass
class _Job:
    id: str
    repo_id: str
    revision: str
    dest: Path
    include: tuple[str, ...] | None = None
    state: JobState = JobState.QUEUED
    error: str | None = None
    commit: str | None = None
    files: list[RepoFile] = field(default_factory=list)
    verified: set[str] = field(default_factory=set)
    done: dict[str, int] = field(default_factory=dict)
    current_file: str | None = None
    note: str | None = None
    created: float = field(default_factory=time.time)
    control: SimpleControl = field(default_factory=SimpleControl)
    thread: threading.Thread | None = None
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    last_emit: float = 0.0

    def done_bytes(self) -> int:
        return sum(self.done.get(f.path, 0) for f in self.files)

    def snapshot(self) -> JobSnapshot:
        total = sum(f.size for f in self.files)
        done = self.done_bytes()
        speed = 0.0
        if self.state == JobState.DOWNLOADING and len(self.samples) >= 2:
            (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
            if t1 - t0 > 0.2:
                speed = max(0.0, (d1 - d0) / (t1 - t0))
        eta = (total - done) / speed if speed > 0 else None
        return JobSnapshot(
            id=self.id,
            repo_id=self.repo_id,
            revision=self.revision,
            dest=self.dest,
            state=self.state,
            error=self.error,
            commit=self.commit,
            files=tuple(
                FileStatus(f.path, f.size, self.done.get(f.path, 0), f.path in self.verified)
                for f in self.files
            ),
            done_bytes=done,
            total_bytes=total,
            speed=speed,
            eta=eta,
            current_file=self.current_file,
            note=self.note,
            created=self.created,
        )


class DownloadManager:
    """A queue of model downloads, ``max_concurrent`` at a time. No Qt; usable from the CLI.

    ``models_dir``: where ``owner__name[@branch]`` folders are created by default.
    ``state_path``: the queue's JSON file (None: the queue lives in memory only).
    ``autostart``: start queued (and restored) jobs immediately; False leaves them queued until
    ``start()`` is called (the GUI wires listeners first).
    """

    def __init__(
        self,
        models_dir: Path | None = None,
        *,
        client: HubClient | None = None,
        state_path: Path | None = None,
        max_concurrent: int = 2,
        retry: RetryPolicy | None = None,
        chunk_size: int | None = None,
        stall_timeout: float = 30.0,
        progress_interval: float = 0.2,
        free_space_margin: int = 64 << 20,
        mismatch_retries: int = 1,
        autostart: bool = True,
    ) -> None:
        self.models_dir = Path(models_dir) if models_dir is not None else default_models_dir()
        self.client = client or HubClient()
        self.state_path = Path(state_path) if state_path is not None else None
        self.max_concurrent = max(1, max_concurrent)
        self.retry = retry or RetryPolicy()
        self.chunk_size = chunk_size
        self.stall_timeout = stall_timeout
        self.progress_interval = progress_interval
        self.free_space_margin = free_space_margin
        self.mismatch_retries = mismatch_retries
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._save_lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._listeners: list[Listener] = []
        self._started = autostart
        self._closed = False
        if self.state_path is not None:
            self._load_state()
        if autostart:
            self._schedule()

    @staticmethod
    def default_state_path(models_dir: Path | None = None) -> Path:
        return Path(models_dir or default_models_dir()) / ".trellis-downloads.json"

    # -- public API ------------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` on every change (from worker threads). Returns an unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def start(self) -> None:
        """Start running queued jobs (only needed with ``autostart=False``)."""
        with self._lock:
            self._started = True
        self._schedule()

    def jobs(self) -> list[JobSnapshot]:
        with self._lock:
            return [j.snapshot() for j in self._jobs.values()]

    def job(self, job_id: str) -> JobSnapshot:
        with self._lock:
            return self._get(job_id).snapshot()

    def dest_for(self, repo_id: str, revision: str = "main") -> Path:
        return self.models_dir / model_dir_name(repo_id, revision)

    def enqueue(
        self,
        repo_id: str,
        revision: str = "main",
        dest: Path | None = None,
        include: Iterable[str] | None = None,
    ) -> str:
        """Queue a download of ``repo_id`` at ``revision`` (branch, tag or commit); returns its id.

        Enqueuing what is already queued or running returns the existing job's id.
        """
        revision = revision or "main"
        target = Path(dest) if dest is not None else self.dest_for(repo_id, revision)
        with self._lock:
            for j in self._jobs.values():
                if j.dest == target and j.state not in TERMINAL_STATES:
                    if j.state == JobState.PAUSED:
                        self._set_state(j, JobState.QUEUED)
                    self._schedule_locked()
                    return j.id
            # A finished record for the same folder is replaced by the new download.
            for old in [j for j in self._jobs.values() if j.dest == target]:
                del self._jobs[old.id]
                self._emit_locked("removed", old)
            job = _Job(
                id=uuid.uuid4().hex[:12],
                repo_id=repo_id,
                revision=revision,
                dest=target,
                include=tuple(include) if include else None,
            )
            self._restore_progress(job)
            self._jobs[job.id] = job
            self._emit_locked("added", job)
        self._save_state()
        self._schedule()
        return job.id

    def pause(self, job_id: str) -> None:
        """Stop a job at the next chunk, keeping its data; a queued job just stays queued-paused."""
        with self._lock:
            job = self._get(job_id)
            if job.state in RUNNING_STATES:
                job.control.request_stop("pause")
                job.note = "pausing…"
                self._emit_locked("changed", job)
            elif job.state == JobState.QUEUED:
                self._set_state(job, JobState.PAUSED)
        self._save_state()

    def resume(self, job_id: str) -> None:
        """Queue a paused or failed job again; it continues from the data on disk."""
        with self._lock:
            job = self._get(job_id)
            if job.state in (JobState.PAUSED, JobState.FAILED, JobState.CANCELLED):
                job.error = None
                self._set_state(job, JobState.QUEUED)
        self._save_state()
        self._schedule()

    def cancel(self, job_id: str) -> None:
        """Stop a job and delete its partial data. A completed model is left alone."""
        with self._lock:
            job = self._get(job_id)
            if job.state in RUNNING_STATES:
                job.control.request_stop("cancel")
                job.note = "cancelling…"
                self._emit_locked("changed", job)
                return
            if job.state in (JobState.COMPLETED, JobState.CANCELLED):
                return
        self._discard_partial(job)
        with self._lock:
            job.done.clear()
            job.verified.clear()
            self._set_state(job, JobState.CANCELLED)
        self._save_state()

    def remove(self, job_id: str) -> None:
        """Forget a finished, failed, cancelled or paused job (its files are not touched)."""
        with self._lock:
            job = self._get(job_id)
            if job.state in RUNNING_STATES or job.state == JobState.QUEUED:
                raise DownloadError(f"{job.repo_id} is still downloading; pause or cancel it first")
            del self._jobs[job_id]
            self._emit_locked("removed", job)
        self._save_state()

    def wait(self, job_id: str, timeout: float | None = None) -> JobSnapshot:
        """Block until the job is paused, completed, failed or cancelled (or ``timeout`` passes)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                job = self._get(job_id)
                if job.state in TERMINAL_STATES or (job.state == JobState.PAUSED and job.thread is None):
                    return job.snapshot()
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return job.snapshot()
                self._changed.wait(left if left is not None else 1.0)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop running jobs so that they resume on the next start (state stays queued)."""
        with self._lock:
            self._closed = True
            running = [j for j in self._jobs.values() if j.thread is not None]
            for j in running:
                j.control.request_stop("shutdown")
        end = time.monotonic() + timeout
        for j in running:
            t = j.thread
            if t is not None:
                t.join(max(0.0, end - time.monotonic()))
        self._save_state()

    # -- scheduling ------------------------------------------------------------------------------

    def _schedule(self) -> None:
        with self._lock:
            self._schedule_locked()

    def _schedule_locked(self) -> None:
        if not self._started or self._closed:
            return
        running = sum(1 for j in self._jobs.values() if j.thread is not None)
        for job in sorted(self._jobs.values(), key=lambda j: j.created):
            if running >= self.max_concurrent:
                break
            if job.state == JobState.QUEUED and job.thread is None:
                job.control.clear()
                job.thread = threading.Thread(
                    target=self._run, args=(job,), name=f"download-{job.id}", daemon=True
                )
                running += 1
                self._set_state(job, JobState.STARTING)
                job.thread.start()

    # -- the work of one job (its own thread) ----------------------------------------------------

    def _run(self, job: _Job) -> None:
        final: JobState = JobState.FAILED
        error: str | None = None
        try:
            self._download(job)
            final = JobState.COMPLETED
        except StopRequested as stop:
            if stop.reason == "cancel":
                self._discard_partial(job)
                with self._lock:
                    job.done.clear()
                    job.verified.clear()
                final = JobState.CANCELLED
            elif stop.reason == "shutdown":
                final = JobState.QUEUED
            else:
                final = JobState.PAUSED
        except HubError as exc:
            error = str(exc)
        except Exception as exc:  # a bug or an unexpected library error: report it, keep the data
            hub_error = translate_error(
                exc, job.repo_id, job.revision, self.client.token() is not None, self.client.endpoint
            )
            error = str(hub_error)
            if type(hub_error) is HubError:
                log.exception("download of %s failed unexpectedly", job.repo_id)
        with self._lock:
            job.thread = None
            job.current_file = None
            job.note = None
            job.error = error
            job.samples.clear()
            job.state = final
        # Persist the final state before anyone is told: a waiter may act (or the app exit) at once.
        self._save_state()
        with self._lock:
            self._set_state(job, final)
        self._schedule()

    def _download(self, job: _Job) -> None:
        plan = self._load_or_make_plan(job)
        files = [RepoFile.from_json(f) for f in plan["files"]]
        marker = read_marker(job.dest)
        if (
            marker is not None
            and marker.get("commit") == plan["commit"]
            and all(_size(self._final_path(job, f.path)) == f.size for f in files)
        ):
            shutil.rmtree(self._partial(job), ignore_errors=True)  # already complete at this commit
            with self._lock:
                job.verified = {f.path for f in files}
                job.done = {f.path: f.size for f in files}
            return
        token = self.client.token()
        if plan.get("gated") and token is None:
            raise GatedRepoError(
                f"{job.repo_id} is gated: accept its terms at {self.client.endpoint}/{job.repo_id}, "
                "then set a Hugging Face token (HF_TOKEN, or save one in the app's settings)."
            )
        self._check_space(job, files)
        with self._lock:
            self._set_state(job, JobState.DOWNLOADING)
        self._save_state()
        for f in files:
            if f.path in job.verified:
                continue
            self._fetch_verified(job, plan, f)
            with self._lock:
                job.verified.add(f.path)
            for entry in plan["files"]:
                if entry["path"] == f.path:
                    entry["verified"] = True
            atomic_write_json(self._partial(job) / PLAN_FILE, plan)
        if (reason := job.control.stop_reason()) is not None:
            raise StopRequested(reason)
        with self._lock:
            self._set_state(job, JobState.FINALIZING)
        self._finalize(job, plan, files)

    def _fetch_verified(self, job: _Job, plan: dict, f: RepoFile) -> None:
        part = self._part_path(job, f.path)
        url = self.client.file_url(job.repo_id, f.path, plan["commit"])
        with self._lock:
            job.current_file = f.path
        mismatches = 0
        while True:
            try:
                fetch_file(
                    url,
                    f,
                    part,
                    headers=self.client.headers(),
                    control=job.control,
                    on_progress=lambda done, path=f.path: self._progress(job, path, done),
                    on_retry=lambda n, delay, why: self._note(job, f"retry {n} in {delay:.0f} s ({why})"),
                    retry=self.retry,
                    chunk_size=self.chunk_size,
                    stall_timeout=self.stall_timeout,
                )
                return
            except VerificationError as exc:
                # Corrupt bytes are useless for a resume: drop them, try once more from zero.
                part.unlink(missing_ok=True)
                self._progress(job, f.path, 0, force=True)
                mismatches += 1
                if mismatches > self.mismatch_retries:
                    raise VerificationError(
                        f"{job.repo_id}: {exc} (the corrupt file was deleted; "
                        "the model is not marked complete)"
                    ) from None
                log.warning("%s: %s; downloading the file again", job.repo_id, exc)
                self._note(job, f"{f.path} failed verification; downloading it again")

    def _load_or_make_plan(self, job: _Job) -> dict:
        path = self._partial(job) / PLAN_FILE
        plan = read_json(path)
        if (
            isinstance(plan, dict)
            and plan.get("repo_id") == job.repo_id
            and plan.get("revision") == job.revision
            and plan.get("include") == (list(job.include) if job.include else None)
        ):
            # Resume against the commit pinned when the download started; the plan on disk may
            # predate the path checks, so its names are checked like a fresh listing.
            self._check_paths(
                job, [f.get("path") for f in plan.get("files", [])], "its saved plan is not used"
            )
        else:
            details = self.client.model_details(job.repo_id, job.revision, with_branches=False)
            # Every listed name, not only the included ones: a listing with one hostile name comes
            # from a hostile or broken server, and "*.bin" would match "../../x.bin" anyway.
            self._check_paths(job, [f.path for f in details.files], "no file of it was written")
            files = [f for f in details.files if _included(f.path, job.include)]
            if not files:
                raise DownloadError(
                    f"{job.repo_id}@{job.revision} has no files matching {list(job.include or [])}"
                )
            plan = {
                "repo_id": job.repo_id,
                "revision": job.revision,
                "include": list(job.include) if job.include else None,
                "commit": details.commit,
                "gated": details.gated,
                "files": [dict(f.to_json(), verified=False) for f in files],
                "created": time.time(),
            }
            atomic_write_json(path, plan)
        if (reason := job.control.stop_reason()) is not None:
            raise StopRequested(reason)
        with self._lock:
            job.commit = plan["commit"]
            job.files = [RepoFile.from_json(f) for f in plan["files"]]
            job.verified = set()
            for entry in plan["files"]:
                size_on_disk = _size(self._part_path(job, entry["path"]))
                if entry.get("verified") and size_on_disk != int(entry["size"]):
                    # Verified earlier but its part is gone: moved in place by an interrupted finalize?
                    if _size(self._final_path(job, entry["path"])) == int(entry["size"]):
                        size_on_disk = int(entry["size"])
                    else:
                        entry["verified"] = False
                if entry.get("verified"):
                    job.verified.add(entry["path"])
                job.done[entry["path"]] = size_on_disk or 0
            self._emit_locked("changed", job)
        return plan

    def _check_space(self, job: _Job, files: list[RepoFile]) -> None:
        needed = sum(max(0, f.size - job.done.get(f.path, 0)) for f in files if f.path not in job.verified)
        free = disk_free(job.dest)
        if free < needed + self.free_space_margin:
            raise InsufficientSpaceError(
                f"not enough disk space for {job.repo_id}: {format_bytes(needed)} ({needed} bytes) still "
                f"to download plus {format_bytes(self.free_space_margin)} headroom, but only "
                f"{format_bytes(free)} ({free} bytes) free at {job.dest}",
                required=needed + self.free_space_margin,
                free=free,
            )

    def _finalize(self, job: _Job, plan: dict, files: list[RepoFile]) -> None:
        """Move verified files in place, then write the completion marker last."""
        (job.dest / COMPLETE_MARKER).unlink(missing_ok=True)  # the old version is being replaced
        for f in files:
            src = self._part_path(job, f.path)
            dst = self._final_path(job, f.path)
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
            elif _size(dst) != f.size:
                raise DownloadError(f"{job.repo_id}: {f.path} vanished before it could be moved in place")
        fsync_dir(job.dest)
        atomic_write_json(
            job.dest / COMPLETE_MARKER,
            {
                "complete": True,
                "repo_id": job.repo_id,
                "revision": job.revision,
                "commit": plan["commit"],
                "endpoint": self.client.endpoint,
                "files": [f.to_json() for f in files],
                "completed": time.time(),
            },
        )
        shutil.rmtree(self._partial(job), ignore_errors=True)

    def _discard_partial(self, job: _Job) -> None:
        shutil.rmtree(self._partial(job), ignore_errors=True)
        try:
            if job.dest.is_dir() and not any(job.dest.iterdir()):
                job.dest.rmdir()
        except OSError:
            pass

    # -- progress, state, events -----------------------------------------------------------------

    def _progress(self, job: _Job, path: str, done: int, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            before = job.done.get(path, 0)
            job.done[path] = done
            if done < before:
                job.samples.clear()  # a restart from zero is not negative speed
            job.samples.append((now, job.done_bytes()))
            while len(job.samples) > 2 and now - job.samples[0][0] > 5.0:
                job.samples.popleft()
            if job.note and done > before:
                job.note = None
            if force or now - job.last_emit >= self.progress_interval:
                job.last_emit = now
                self._emit_locked("progress", job)

    def _note(self, job: _Job, note: str) -> None:
        with self._lock:
            job.note = note
            self._emit_locked("changed", job)

    def _set_state(self, job: _Job, state: JobState) -> None:
        """Change state and notify (lock held)."""
        job.state = state
        if state != JobState.FAILED:
            job.error = None
        self._emit_locked("changed", job)
        self._changed.notify_all()

    def _emit_locked(self, kind: str, job: _Job) -> None:
        event = DownloadEvent(kind, job.snapshot())  # type: ignore[arg-type]
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken listener must not break a download
                log.exception("download listener failed")

    def _get(self, job_id: str) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise DownloadError(f"no download with id {job_id}") from None

    def _partial(self, job: _Job) -> Path:
        return job.dest / PARTIAL_DIR

    def _part_path(self, job: _Job, path: str) -> Path:
        return _repo_path(self._partial(job) / PARTS_DIR, path, suffix=".part")

    def _final_path(self, job: _Job, path: str) -> Path:
        return _repo_path(job.dest, path)

    def _check_paths(self, job: _Job, paths: Iterable[object], consequence: str) -> None:
        """Refuse the whole download, naming the file, if any name would be written outside the
        model folder. Runs before the plan or any part file is written."""
        for path in paths:
            try:
                self._final_path(job, path)  # type: ignore[arg-type]  # non-str names are refused
                self._part_path(job, path)  # type: ignore[arg-type]
            except UnsafePathError as exc:
                raise UnsafeRepoPathError(
                    f"refusing to download {job.repo_id}@{job.revision}: {exc}; {consequence}",
                    exc.name,
                ) from None

    def _restore_progress(self, job: _Job) -> None:
        """Fill a job's file list and byte counts from an existing plan and its part files."""
        plan = read_json(self._partial(job) / PLAN_FILE)
        if not isinstance(plan, dict) or plan.get("repo_id") != job.repo_id:
            return
        try:
            self._check_paths(job, [f.get("path") for f in plan.get("files", [])], "")
        except UnsafeRepoPathError:
            return  # shown as not started; running it fails with the message naming the file
        job.commit = plan.get("commit")
        job.files = [RepoFile.from_json(f) for f in plan.get("files", [])]
        for entry in plan.get("files", []):
            if entry.get("verified"):
                job.verified.add(entry["path"])
                job.done[entry["path"]] = int(entry["size"])
            else:
                job.done[entry["path"]] = _size(self._part_path(job, entry["path"])) or 0

    # -- persistence of the queue ----------------------------------------------------------------

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        with self._save_lock:
            with self._lock:
                data = {
                    "version": STATE_VERSION,
                    "jobs": [
                        {
                            "id": j.id,
                            "repo_id": j.repo_id,
                            "revision": j.revision,
                            "dest": str(j.dest),
                            "include": list(j.include) if j.include else None,
                            # A running job is saved as queued: that is what it is after a restart.
                            "state": str(JobState.QUEUED if j.state in RUNNING_STATES else j.state),
                            "error": j.error,
                            "commit": j.commit,
                            "created": j.created,
                        }
                        for j in self._jobs.values()
                    ],
                }
            atomic_write_json(self.state_path, data)

    def _load_state(self) -> None:
        assert self.state_path is not None
        data = read_json(self.state_path)
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            return
        for rec in data.get("jobs", []):
            try:
                state = JobState(rec.get("state", "queued"))
                if state in RUNNING_STATES:
                    state = JobState.QUEUED
                job = _Job(
                    id=str(rec["id"]),
                    repo_id=str(rec["repo_id"]),
                    revision=str(rec.get("revision") or "main"),
                    dest=Path(rec["dest"]),
                    include=tuple(rec["include"]) if rec.get("include") else None,
                    state=state,
                    error=rec.get("error"),
                    commit=rec.get("commit"),
                    created=float(rec.get("created") or time.time()),
                )
            except (KeyError, ValueError, TypeError):
                log.warning("skipping an unreadable record in %s", self.state_path)
                continue
            if job.state == JobState.COMPLETED:
                marker = read_marker(job.dest)
                if marker is None:
                    continue  # deleted by the user since: drop the record
                job.files = [RepoFile.from_json(f) for f in marker.get("files", [])]
                job.done = {f.path: f.size for f in job.files}
                job.verified = {f.path for f in job.files}
            else:
                self._restore_progress(job)
            self._jobs[job.id] = job


def _repo_path(root: Path, path: str, suffix: str = "") -> Path:
    """The one place a file name from a Hub listing becomes a path on disk (final or part file).

    On top of ``safe_join``'s rules, the names of this module's own bookkeeping are refused: a
    listed ``.trellis-partial/parts/config.json.part`` would be moved over the verified part of
    ``config.json`` at finalize, putting unverified content under a verified name.
    """
    if isinstance(path, str) and (path.split("/", 1)[0] == PARTIAL_DIR or path == COMPLETE_MARKER):
        raise UnsafeRepoPathError(
            f"unsafe file path {path!r}: it is a name the download manager keeps for itself", path
        )
    return safe_join(root, path, suffix=suffix, error=UnsafeRepoPathError)


def _included(path: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatch(path, p) for p in patterns)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


__all__ = [
    "DownloadEvent",
    "DownloadManager",
    "FileStatus",
    "JobSnapshot",
    "JobState",
    "disk_free",
]
