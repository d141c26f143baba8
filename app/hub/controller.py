"""``HubController``: runs ``engine.hub.HubClient`` calls off the GUI thread and hands the results
back through queued signals. Each request carries a sequence number; an answer to a request that
has since been superseded (the user typed a new search, clicked another model) or cancelled is
dropped. ``cancel`` ends the wait at once (the request's thread finishes on its own: without a
network that takes seconds, ``engine.hub.reachability``), and ``retry`` sends the failed request
again. Being offline is logged once, not once per request.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine.hub.client import HubClient, ModelDetails, SearchQuery
from engine.hub.errors import HubConnectionError, HubError
from engine.hub.memory import MachineMemory, MemoryEstimate, estimate_memory, machine_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPage:
    """Everything the model page shows for one repo at one revision."""

    details: ModelDetails
    card: str
    config: dict[str, Any] | None


class HubController(QObject):
    searchFinished = Signal(list)  # list[ModelSummary]
    pageReady = Signal(object)  # ModelPage
    failed = Signal(str)  # a message for the user (``offline`` says whether it is "no network")
    busyChanged = Signal(bool)
    _done = Signal(str, int, object, object)  # kind, seq, result, error (from worker threads)

    def __init__(self, client: HubClient | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client or HubClient()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hub")
        self._seq: dict[str, int] = {"search": 0, "page": 0}
        self._waiting: set[str] = set()  # kinds whose latest request has not answered yet
        self._work: dict[str, Any] = {}  # the latest request of each kind, for retry()
        self._failed_kind: str | None = None
        self.offline = False  # the last failure was "cannot reach the Hub"
        self._machine: MachineMemory | None = None
        self._done.connect(self._finish, Qt.ConnectionType.QueuedConnection)
        self.destroyed.connect(lambda *_, pool=self._pool: pool.shutdown(wait=False, cancel_futures=True))

    # -- requests (GUI thread) ---------------------------------------------------------------------

    def search(self, query: SearchQuery) -> None:
        self._submit("search", lambda: self.client.search(query))

    def open_model(self, repo_id: str, revision: str = "main") -> None:
        """Fetch the page of ``repo_id`` at ``revision``: details (with branches), card and config."""

        def work() -> ModelPage:
            details = self.client.model_details(repo_id, revision, with_branches=True)
            card = self.client.model_card(repo_id, revision)
            config = (
                self.client.config(repo_id, revision)
                if any(f.path == "config.json" for f in details.files)
                else None
            )
            if self._machine is None:
                self._machine = machine_memory()
            return ModelPage(details, card, config)

        self._submit("page", work)

    def estimate(self, page: ModelPage, context_length: int) -> MemoryEstimate:
        """Memory needed for ``page`` at ``context_length`` (pure arithmetic: runs on the caller)."""
        if self._machine is None:
            self._machine = machine_memory()
        return estimate_memory(page.config, page.details.weights_size, context_length, machine=self._machine)

    # -- plumbing ----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._waiting)

    def cancel(self) -> None:
        """Stop waiting for the requests in flight: their answers will be dropped."""
        if not self._waiting:
            return
        for kind in self._waiting:
            self._seq[kind] += 1
        self._waiting.clear()
        self.busyChanged.emit(False)

    def retry(self) -> None:
        """Send the request that failed last time again."""
        kind = self._failed_kind
        if kind is not None and kind in self._work:
            self._submit(kind, self._work[kind])

    def _submit(self, kind: str, work) -> None:
        self._seq[kind] += 1
        seq = self._seq[kind]
        self._work[kind] = work
        was_busy = self.busy
        self._waiting.add(kind)
        if not was_busy:
            self.busyChanged.emit(True)

        def run() -> None:
            try:
                result = work()
            except HubError as exc:
                self._done.emit(kind, seq, None, exc)
            except Exception as exc:  # unexpected: keep the GUI alive, say what happened
                log.exception("hub request failed")
                self._done.emit(kind, seq, None, HubError(f"{type(exc).__name__}: {exc}"))
            else:
                self._done.emit(kind, seq, result, None)

        self._pool.submit(run)

    @Slot(str, int, object, object)
    def _finish(self, kind: str, seq: int, result: object, error: object) -> None:
        if seq != self._seq[kind]:
            return  # superseded or cancelled
        self._waiting.discard(kind)
        if not self._waiting:
            self.busyChanged.emit(False)
        if error is not None:
            offline = isinstance(error, HubConnectionError)
            if offline and not self.offline:
                log.warning("the Hub cannot be reached: %s", error)  # once, until it answers again
            self.offline, self._failed_kind = offline, kind
            self.failed.emit(str(error))
            return
        if self.offline:
            log.info("the Hub answers again")
        self.offline, self._failed_kind = False, None
        if kind == "search":
            self.searchFinished.emit(result)
        else:
            self.pageReady.emit(result)
