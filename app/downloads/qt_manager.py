"""The engine's download manager, seen from the GUI thread.

``engine.hub.DownloadManager`` calls its listeners from its download threads. ``QtDownloadManager``
registers one listener that only emits a signal with an explicit queued connection, so every
``jobAdded`` / ``jobChanged`` / ``jobRemoved`` / ``modelInstalled`` reaches slots on the GUI thread,
the only thread that may touch the Qt item models. Method calls (``enqueue``, ``pause``...) go
straight to the engine manager, which is thread-safe and never blocks on the network.

Use ``QtDownloadManager.wrap(manager)`` to get the one wrapper of an engine manager (the Hub pane
and the Downloads pane share it).
"""

from __future__ import annotations

import weakref
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine.hub.downloads import DownloadEvent, DownloadManager, JobSnapshot, JobState

_WRAPPERS: weakref.WeakKeyDictionary[DownloadManager, QtDownloadManager] = weakref.WeakKeyDictionary()


class QtDownloadManager(QObject):
    """Signals of a ``DownloadManager`` on the GUI thread; all payloads are immutable snapshots."""

    jobAdded = Signal(object)  # JobSnapshot
    jobChanged = Signal(object)  # JobSnapshot (state change or progress)
    jobRemoved = Signal(str)  # job id
    modelInstalled = Signal(str)  # path of a model that just completed and verified
    _event = Signal(object)  # from download threads; queued to this object's thread

    def __init__(self, manager: DownloadManager, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.manager = manager
        self._event.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)
        self._unsubscribe = unsubscribe = manager.add_listener(self._event.emit)
        # A deleted wrapper must not keep receiving events from download threads.
        self.destroyed.connect(lambda *_: unsubscribe())

    @classmethod
    def wrap(
        cls, manager: DownloadManager | QtDownloadManager, parent: QObject | None = None
    ) -> QtDownloadManager:
        """The shared wrapper of ``manager`` (created on first use); a wrapper is returned as is."""
        if isinstance(manager, QtDownloadManager):
            return manager
        existing = _WRAPPERS.get(manager)
        if existing is not None:
            return existing
        wrapper = cls(manager, parent)
        _WRAPPERS[manager] = wrapper
        return wrapper

    @Slot(object)
    def _dispatch(self, event: DownloadEvent) -> None:
        if event.kind == "added":
            self.jobAdded.emit(event.job)
        elif event.kind == "removed":
            self.jobRemoved.emit(event.job.id)
        else:
            self.jobChanged.emit(event.job)
            if event.kind == "changed" and event.job.state == JobState.COMPLETED:
                self.modelInstalled.emit(str(event.job.dest))

    # -- commands (thread-safe, non-blocking) ------------------------------------------------------

    def jobs(self) -> list[JobSnapshot]:
        return self.manager.jobs()

    def enqueue(self, repo_id: str, revision: str = "main", dest: Path | None = None) -> str:
        return self.manager.enqueue(repo_id, revision, dest=dest)

    def pause(self, job_id: str) -> None:
        self.manager.pause(job_id)

    def resume(self, job_id: str) -> None:
        self.manager.resume(job_id)

    def cancel(self, job_id: str) -> None:
        self.manager.cancel(job_id)

    def remove(self, job_id: str) -> None:
        self.manager.remove(job_id)

    def close(self) -> None:
        """Stop listening (the engine manager keeps running until its own ``shutdown``)."""
        self._unsubscribe()
