"""The downloads queue pane (a view over ``engine.hub.DownloadManager``).

Entry points for the main window:

* ``create_downloads_pane(download_manager, parent=None) -> DownloadsPane``: ``download_manager`` is
  the engine's ``DownloadManager`` (or an existing ``QtDownloadManager``). The pane shows every
  job with status, a progress bar, size, speed and ETA, and Pause/Resume/Cancel/Remove/Open folder
  buttons for the selected one.
* ``QtDownloadManager.wrap(download_manager)`` (``app.downloads.qt_manager``): the shared GUI-thread
  wrapper; connect to its ``modelInstalled(str path)`` signal to refresh the library when a model
  finished and verified (``jobAdded``/``jobChanged``/``jobRemoved`` carry ``JobSnapshot``s).

The engine manager should be created with ``autostart=False`` and started (``start()``) after the
panes are built, so no event is missed; call its ``shutdown()`` when the app quits so running
downloads are saved as queued and resume on the next start.
"""

from __future__ import annotations

from PySide6.QtWidgets import QWidget

from app.downloads.qt_manager import QtDownloadManager


def create_downloads_pane(download_manager, parent: QWidget | None = None):
    from app.downloads.pane import DownloadsPane

    return DownloadsPane(QtDownloadManager.wrap(download_manager, parent), parent)


__all__ = ["QtDownloadManager", "create_downloads_pane"]
