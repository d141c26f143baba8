"""``HubController``: runs ``engine.hub.HubClient`` calls off the GUI thread and hands the results
back through queued signals. Each request carries a sequence number; an answer to a request that
has since been superseded (the user typed a new search, clicked another model) is dropped.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine.hub.client import HubClient, ModelDetails, SearchQuery
from engine.hub.errors import HubError
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
    failed = Signal(str)  # a message for the user
    busyChanged = Signal(bool)
    _done = Signal(str, int, object, object)  # kind, seq, result, error (from worker threads)

    def __init__(self, client: HubClient | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client or HubClient()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hub")
        self._seq: dict[str, int] = {"search": 0, "page": 0}
        self._pending = 0
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

    def _submit(self, kind: str, work) -> None:
        self._seq[kind] += 1
        seq = self._seq[kind]
        self._pending += 1
        if self._pending == 1:
            self.busyChanged.emit(True)

        def run() -> None:
            try:
                result = work()
            except HubError as exc:
                self._done.emit(kind, seq, None, str(exc))
            except Exception as exc:  # unexpected: keep the GUI alive, say what happened
                log.exception("hub request failed")
                self._done.emit(kind, seq, None, f"{type(exc).__name__}: {exc}")
            else:
                self._done.emit(kind, seq, result, None)

        self._pool.submit(run)

    @Slot(str, int, object, object)
    def _finish(self, kind: str, seq: int, result: object, error: object) -> None:
        self._pending -= 1
        if self._pending == 0:
            self.busyChanged.emit(False)
        if seq != self._seq[kind]:
            return  # superseded
        if error is not None:
            self.failed.emit(str(error))
        elif kind == "search":
            self.searchFinished.emit(result)
        else:
            self.pageReady.emit(result)
