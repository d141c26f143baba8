"""The Hub browser pane: search the Hugging Face Hub, open a model page, queue downloads.

Entry point for the main window:

* ``create_hub_pane(download_manager, parent=None, client=None) -> HubBrowserPane``:
  ``download_manager`` is the engine's ``DownloadManager`` (or the ``QtDownloadManager`` from
  ``app.downloads.qt_manager``; both panes share one wrapper). ``client`` is an
  ``engine.hub.HubClient`` (default: ``HF_ENDPOINT`` and the user's token, resolved per request).

The pane runs every network call through ``HubController`` (a thread pool; results come back by
queued signals), so the GUI never waits on the network.
"""

from __future__ import annotations

from PySide6.QtWidgets import QWidget

from app.downloads.qt_manager import QtDownloadManager


def create_hub_pane(download_manager, parent: QWidget | None = None, client=None):
    from app.hub.controller import HubController
    from app.hub.pane import HubBrowserPane

    wrapper = QtDownloadManager.wrap(download_manager, parent)
    pane = HubBrowserPane(HubController(client), wrapper, parent)
    pane.controller.setParent(pane)
    return pane


__all__ = ["create_hub_pane"]
