"""The "GPU runtime" box of the Settings pane: the managed CUDA runtime (``app.runtime``) that the
first-run offer installs, what it takes on disk, and a way to remove it.

Removing asks first, saying how much disk it frees and that the app uses the CPU after a restart
(the running process keeps the torch it imported), then deletes the gigabytes on a thread of its
own while the box says "Removing..." (the window stays responsive). Afterwards the box says so and, where the
first-run offer would apply on the CPU build, offers the same download dialog again.

Shown in the bundle (which manages its runtime) and wherever a runtime is installed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGroupBox, QHBoxLayout, QLabel, QMessageBox, QPushButton, QVBoxLayout, QWidget

from app.gpu_check import GpuReport
from app.runtime.activate import RECORD, managed_runtime_enabled
from app.runtime.install import installed_runtime, remove_runtime
from app.runtime.lock import RuntimeLock
from app.runtime.offer import offer_after_removal, open_runtime_dialog
from engine.units import format_bytes

log = logging.getLogger(__name__)


def folder_size(folder: Path) -> int:
    """Bytes of every file under ``folder`` (links not followed; 0 for a folder that is not there)."""
    total = 0
    for directory, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue  # gone meanwhile: it takes no space
    return total


def runtime_description(folder: Path) -> str:
    """ "torch 2.13.0 for CUDA 13.0" from the runtime's record, or its folder name."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        return f"torch {record['torch']} for CUDA {record['cuda']}"
    except (OSError, ValueError, KeyError, TypeError):
        return folder.name


class GpuRuntimeBox(QGroupBox):
    """``root`` is the runtime folder (``app.runtime.activate.runtime_root``); ``open_offer`` opens
    the download dialog for a lock (the window passes one that parents it to itself)."""

    # (bytes freed, "" or why some files stayed): from the removal thread to the GUI thread
    removed = Signal(object, str)

    def __init__(
        self,
        root: Path,
        parent: QWidget | None = None,
        open_offer: Callable[[RuntimeLock, GpuReport], QWidget] | None = None,
    ) -> None:
        super().__init__("GPU runtime", parent)
        self.setAccessibleName("GPU runtime")
        self.root = Path(root)
        self.report: GpuReport | None = None
        self.removed_bytes: int | None = None  # set once removed in this session
        self.dialog: QWidget | None = None  # the download dialog, once offered
        self.removal: threading.Thread | None = None  # deleting the runtime, once asked
        self._open_offer = open_offer or (
            lambda lock, report: open_runtime_dialog(self.window(), lock, report, self.root.parent)
        )
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.remove_button = QPushButton("Remove GPU runtime…")
        self.remove_button.setAccessibleName("Remove GPU runtime")
        self.install_button = QPushButton("Install GPU runtime…")
        self.install_button.setAccessibleName("Install GPU runtime")
        buttons = QHBoxLayout()
        buttons.addWidget(self.remove_button)
        buttons.addWidget(self.install_button)
        buttons.addStretch(1)
        column = QVBoxLayout(self)
        column.addWidget(self.status)
        column.addLayout(buttons)
        self.remove_button.clicked.connect(self.confirm_remove)
        self.install_button.clicked.connect(self.offer_install)
        self.removed.connect(self._on_removed)
        self.refresh()

    def set_report(self, report: GpuReport) -> None:
        """The startup GPU check's report: what decides whether a download can be offered."""
        self.report = report
        self.refresh()

    def installed(self) -> Path | None:
        folder = installed_runtime(self.root)
        return folder if folder is not None and folder.is_dir() else None

    def refresh(self) -> None:
        folder = self.installed()
        self.setVisible(folder is not None or self.removed_bytes is not None or managed_runtime_enabled())
        self.remove_button.setVisible(folder is not None)
        self.install_button.setVisible(folder is None and offer_after_removal(self.report) is not None)
        if folder is not None:
            self.status.setText(
                f"Installed: {runtime_description(folder)}, {format_bytes(folder_size(folder))} in {folder}."
            )
        elif self.removed_bytes is not None:
            self.status.setText(
                f"The GPU runtime was removed ({format_bytes(self.removed_bytes)} freed). "
                "Trellis Chat uses the CPU after a restart."
            )
        else:
            self.status.setText("Not installed: models run on the CPU.")

    def confirm_remove(self) -> None:
        folder = self.installed()
        if folder is None:
            self.refresh()
            return
        size = folder_size(folder)
        answer = QMessageBox.question(
            self,
            "Remove GPU runtime",
            f"Remove the GPU runtime ({runtime_description(folder)})? This frees {format_bytes(size)} "
            "of disk. Trellis Chat will use the CPU after a restart.",
        )
        if answer != QMessageBox.StandardButton.Yes:
            return
        self.remove_button.setEnabled(False)
        self.status.setText(f"Removing the GPU runtime ({format_bytes(size)})...")
        self.removal = threading.Thread(
            target=self._remove, args=(size,), name="remove-gpu-runtime", daemon=True
        )
        self.removal.start()

    def _remove(self, size: int) -> None:
        """On the removal thread: delete, then tell the GUI thread (a queued signal)."""
        try:
            remove_runtime(self.root)
        except OSError as exc:
            self.removed.emit(size, str(exc))
        else:
            self.removed.emit(size, "")

    def _on_removed(self, size: int, error: str) -> None:
        if error:
            # ``current`` goes first, so the next start uses the CPU even if files stay behind
            # (on Windows the running app holds the runtime's libraries open).
            log.warning("could not remove all of the GPU runtime: %s", error)
            QMessageBox.warning(
                self,
                "Remove GPU runtime",
                f"Trellis Chat uses the CPU after a restart, but some files could not be deleted: {error}",
            )
        self.removed_bytes = size
        self.remove_button.setEnabled(True)
        self.refresh()

    def offer_install(self) -> None:
        lock = offer_after_removal(self.report)
        if lock is not None and self.report is not None:
            self.dialog = self._open_offer(lock, self.report)
            finished = getattr(self.dialog, "finished", None)
            if finished is not None:  # installed (or not) meanwhile: say what is there now
                finished.connect(lambda _result: self.refresh())
