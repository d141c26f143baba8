"""``DownloadsModel``: one row per download, fed only by ``QtDownloadManager`` signals (GUI thread)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, Qt

from app.table_model import ColumnTableModel
from engine.hub.downloads import JobSnapshot, JobState
from engine.units import format_bytes

JOB_ROLE = Qt.ItemDataRole.UserRole + 1  # the JobSnapshot of the row
FRACTION_ROLE = Qt.ItemDataRole.UserRole + 2  # 0.0-1.0, for the progress delegate

COLUMNS = ("Model", "Revision", "Status", "Progress", "Size", "Speed", "ETA")
PROGRESS_COLUMN = COLUMNS.index("Progress")

_STATUS_TEXT = {
    JobState.QUEUED: "Queued",
    JobState.STARTING: "Starting",
    JobState.DOWNLOADING: "Downloading",
    JobState.FINALIZING: "Finishing",
    JobState.PAUSED: "Paused",
    JobState.COMPLETED: "Completed",
    JobState.FAILED: "Failed",
    JobState.CANCELLED: "Cancelled",
}


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def status_text(job: JobSnapshot) -> str:
    text = _STATUS_TEXT.get(job.state, str(job.state))
    if job.note:
        text += f" ({job.note})"
    return text


class DownloadsModel(ColumnTableModel):
    COLUMNS = COLUMNS

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self._rows: list[JobSnapshot] = []

    # -- updates (slots for QtDownloadManager signals) ---------------------------------------------

    def reset(self, jobs: list[JobSnapshot]) -> None:
        self.beginResetModel()
        self._rows = sorted(jobs, key=lambda j: j.created)
        self.endResetModel()

    def upsert(self, job: JobSnapshot) -> None:
        row = self.row_of(job.id)
        if row is None:
            self.beginInsertRows(QModelIndex(), len(self._rows), len(self._rows))
            self._rows.append(job)
            self.endInsertRows()
        else:
            self._rows[row] = job
            self.dataChanged.emit(self.index(row, 0), self.index(row, len(COLUMNS) - 1))

    def remove(self, job_id: str) -> None:
        row = self.row_of(job_id)
        if row is not None:
            self.beginRemoveRows(QModelIndex(), row, row)
            del self._rows[row]
            self.endRemoveRows()

    def row_of(self, job_id: str) -> int | None:
        return next((i for i, j in enumerate(self._rows) if j.id == job_id), None)

    def job_at(self, row: int) -> JobSnapshot:
        return self._rows[row]

    # -- QAbstractTableModel -----------------------------------------------------------------------

    def data(
        self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole
    ) -> Any:
        if not index.isValid():
            return None
        job = self._rows[index.row()]
        col = COLUMNS[index.column()]
        if role == JOB_ROLE:
            return job
        if role == FRACTION_ROLE:
            return job.fraction
        if role == Qt.ItemDataRole.ToolTipRole:
            return job.error or str(job.dest)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if col == "Model":
            return job.repo_id
        if col == "Revision":
            return job.revision
        if col == "Status":
            return status_text(job)
        if col == "Progress":
            return f"{100 * job.fraction:.0f}%"
        if col == "Size":
            return (
                f"{format_bytes(job.done_bytes)} / {format_bytes(job.total_bytes)}" if job.total_bytes else ""
            )
        if col == "Speed":
            return f"{format_bytes(job.speed)}/s" if job.speed else ""
        if col == "ETA":
            return format_eta(job.eta) if job.state == JobState.DOWNLOADING else ""
        return None
