"""``DownloadsPane``: the queue as a table with a progress bar column, and the buttons that act on
the selected download. The view only displays ``DownloadsModel``; the pane is the controller that
connects the model to ``QtDownloadManager`` and the buttons to its commands. An empty queue says
where downloads come from, with a button to the Discover pane (``discoverRequested``)."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QModelIndex, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionProgressBar,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.downloads.model import FRACTION_ROLE, JOB_ROLE, PROGRESS_COLUMN, DownloadsModel
from app.downloads.qt_manager import QtDownloadManager
from app.elided_label import never_widen
from app.empty_state import EmptyStack, EmptyState
from engine.hub.downloads import RUNNING_STATES, JobSnapshot, JobState


class ProgressDelegate(QStyledItemDelegate):
    """Paints the Progress column as a progress bar (the model gives a fraction)."""

    def paint(self, painter, option, index) -> None:
        fraction = index.data(FRACTION_ROLE) or 0.0
        bar = QStyleOptionProgressBar()
        bar.rect = option.rect.adjusted(2, 3, -2, -3)
        bar.minimum, bar.maximum = 0, 1000
        bar.progress = int(1000 * fraction)
        bar.text = index.data() or ""
        bar.textVisible = True
        style = option.widget.style() if option.widget else QApplication.style()
        style.drawControl(QStyle.ControlElement.CE_ProgressBar, bar, painter)


class DownloadsPane(QWidget):
    discoverRequested = Signal()  # the empty queue's "Browse models"

    def __init__(self, manager: QtDownloadManager, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.manager = manager
        self.model = DownloadsModel(self)
        self.model.reset(manager.jobs())
        manager.jobAdded.connect(self.model.upsert)
        manager.jobChanged.connect(self.model.upsert)
        manager.jobRemoved.connect(self.model.remove)

        self.view = QTableView(self)
        self.view.setModel(self.model)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.setItemDelegateForColumn(PROGRESS_COLUMN, ProgressDelegate(self.view))
        # Every column as wide as its text ("97.9 KiB / 97.9 KiB" on one line); the name takes
        # the rest, elided in the middle.
        header = self.view.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setMinimumSectionSize(70)
        header.setSectionResizeMode(PROGRESS_COLUMN, QHeaderView.ResizeMode.Fixed)
        header.resizeSection(PROGRESS_COLUMN, 130)
        self.view.setWordWrap(False)
        self.view.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.view.verticalHeader().hide()

        self.pause_button = QPushButton("Pause", self)
        self.resume_button = QPushButton("Resume", self)
        self.cancel_button = QPushButton("Cancel", self)
        self.remove_button = QPushButton("Remove from list", self)
        self.open_button = QPushButton("Open folder", self)
        self.detail = never_widen(QLabel(self))  # a long path wraps, it never widens the window

        buttons = QHBoxLayout()
        for b in (
            self.pause_button,
            self.resume_button,
            self.cancel_button,
            self.remove_button,
            self.open_button,
        ):
            buttons.addWidget(b)
        buttons.addStretch(1)
        self.empty = EmptyState(
            "No downloads",
            "Models you download from Discover are listed here with their progress. "
            "Downloads carry on where they stopped after a restart.",
            "Browse models",
        )
        self.empty.actionRequested.connect(self.discoverRequested)
        self.stack = EmptyStack(self.view, self.empty)
        layout = QVBoxLayout(self)
        layout.addWidget(self.stack, 1)
        layout.addWidget(self.detail)
        layout.addLayout(buttons)

        self.pause_button.clicked.connect(lambda: self._act(self.manager.pause))
        self.resume_button.clicked.connect(lambda: self._act(self.manager.resume))
        self.cancel_button.clicked.connect(lambda: self._act(self.manager.cancel))
        self.remove_button.clicked.connect(lambda: self._act(self.manager.remove))
        self.open_button.clicked.connect(self._open_folder)
        self.view.selectionModel().selectionChanged.connect(self._update_buttons)
        self.model.dataChanged.connect(self._update_buttons)
        self.model.rowsInserted.connect(self._select_new_row)
        for signal in (self.model.rowsInserted, self.model.rowsRemoved, self.model.modelReset):
            signal.connect(self._update_empty)
        self._update_buttons()
        self._update_empty()

    def _update_empty(self, *_args) -> None:
        self.stack.set_empty(self.model.rowCount() == 0)

    def selected_job(self) -> JobSnapshot | None:
        rows = self.view.selectionModel().selectedRows()
        return rows[0].data(JOB_ROLE) if rows else None

    def select_job(self, job_id: str) -> None:
        row = self.model.row_of(job_id)
        if row is not None:
            self.view.selectRow(row)

    def _select_new_row(self, parent: QModelIndex, first: int, last: int) -> None:
        if self.selected_job() is None:
            self.view.selectRow(last)

    def _act(self, command) -> None:
        job = self.selected_job()
        if job is not None:
            command(job.id)

    def _update_buttons(self, *args) -> None:
        job = self.selected_job()
        state = job.state if job else None
        self.pause_button.setEnabled(state in RUNNING_STATES or state == JobState.QUEUED)
        self.resume_button.setEnabled(state in (JobState.PAUSED, JobState.FAILED, JobState.CANCELLED))
        self.cancel_button.setEnabled(
            state is not None and state not in (JobState.COMPLETED, JobState.CANCELLED)
        )
        self.remove_button.setEnabled(
            state in (JobState.PAUSED, JobState.FAILED, JobState.CANCELLED, JobState.COMPLETED)
        )
        self.open_button.setEnabled(job is not None and Path(job.dest).is_dir())
        if job is None:
            self.detail.setText("")
        elif job.error:
            self.detail.setText(f"{job.repo_id}: {job.error}")
        else:
            self.detail.setText(f"{job.repo_id} → {job.dest}")

    def _open_folder(self) -> None:
        job = self.selected_job()
        if job is not None and os.path.isdir(job.dest):
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(job.dest)))
