"""The remote endpoints' models, as rows the model picker shows beside the local ones.

:class:`RemoteCatalog` asks every endpoint for its models (``GET /models``) on a thread of its
own (the keyring and the network may both take their time) and fills :attr:`model` on the GUI
thread: one row per model, its ``PATH_ROLE`` the model's reference (:mod:`app.remote.refs`),
so the picker hands it to the same load path as a local folder. An endpoint that cannot answer
gets no rows, and ``endpointFailed`` says why.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel

from app.library.model import PATH_ROLE
from app.remote.errors import RemoteError
from app.remote.keys import get_key
from app.remote.refs import host_of, make_ref


class RemoteCatalog(QObject):
    refreshed = Signal()
    endpointFailed = Signal(str, str)  # base URL, why
    _listed = Signal(int, object)  # generation, [(base_url, [model ids] | error text)]

    def __init__(self, columns: int = 1, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.model = QStandardItemModel(0, columns, self)
        self._generation = 0
        self.listed: dict[str, list[str]] = {}  # base URL -> model ids, as last listed
        self._listed.connect(self._on_listed)  # queued: emitted from the listing thread

    def refresh(self, endpoints: Sequence[str]) -> None:
        """List ``endpoints``' models again (the rows change when all have answered)."""
        self._generation += 1
        generation, endpoints = self._generation, list(endpoints)
        if not endpoints:
            self._on_listed(generation, [])
            return
        threading.Thread(
            target=self._list, args=(generation, endpoints), name="remote-catalog", daemon=True
        ).start()

    def _list(self, generation: int, endpoints: list[str]) -> None:
        from app.remote.session import list_models  # the HTTP client, off the GUI thread

        results: list[tuple[str, list[str] | str]] = []
        for base_url in endpoints:
            try:
                results.append((base_url, [card["id"] for card in list_models(base_url, get_key(base_url))]))
            except RemoteError as exc:
                results.append((base_url, str(exc)))
        self._listed.emit(generation, results)

    def _on_listed(self, generation: int, results: list) -> None:
        if generation != self._generation:
            return  # an older listing finished after a newer one was asked for
        self.model.removeRows(0, self.model.rowCount())
        self.listed = {}
        for base_url, found in results:
            if isinstance(found, str):
                self.endpointFailed.emit(base_url, found)
                continue
            self.listed[base_url] = found
            for model_id in found:
                item = QStandardItem(f"{model_id} · {host_of(base_url)}")
                item.setData(make_ref(base_url, model_id), PATH_ROLE)
                item.setToolTip(f"{model_id} on the remote engine {base_url}")
                item.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable)
                self.model.appendRow(item)
        self.refreshed.emit()
