"""The library pane: folders, the table of models, details of the selected one (with the reasons
a broken model cannot load), and a Load button."""

from __future__ import annotations

import html

from PySide6.QtCore import QModelIndex, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QPushButton,
    QSplitter,
    QTableView,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.library.model import INFO_ROLE, LibraryModel
from engine.inspect import MemoryVerdict, ModelInfo
from engine.units import format_bytes, format_count


def details_html(
    info: ModelInfo, verdict: MemoryVerdict | None, context_length: int, device: str = "cpu"
) -> str:
    """What the details panel says about one model."""
    e = html.escape
    rows = [
        ("Folder", str(info.path)),
        ("Architecture", info.architecture or "unknown"),
        ("Parameters", format_count(info.parameter_count)),
        ("Quantization", info.quantization or "unknown"),
        ("Size on disk", format_bytes(info.size_bytes)),
        ("Context length", str(info.context_length or "unknown")),
    ]
    if verdict is not None and info.ok:
        rows.append(
            (
                f"Memory at {context_length} tokens ({device.upper()})",
                f"~{format_bytes(verdict.needed_bytes)} needed, {format_bytes(verdict.available_bytes)} free "
                f"of {format_bytes(verdict.total_bytes)}: {verdict.verdict}",
            )
        )
    table = "".join(f"<tr><td><b>{e(k)}</b></td><td>{e(v)}</td></tr>" for k, v in rows)
    out = f"<h3>{e(info.name)}</h3><table cellpadding='2'>{table}</table>"
    if info.problems:
        items = "".join(f"<li>{e(p)}</li>" for p in info.problems)
        out += f"<p style='color:#c62828;'><b>This model cannot be loaded:</b></p><ul>{items}</ul>"
    return out


class LibraryPane(QWidget):
    loadRequested = Signal(str)
    addFolderRequested = Signal(str)
    removeFolderRequested = Signal(str)
    refreshRequested = Signal()

    def __init__(self, model: LibraryModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setAccessibleName("Model library")
        layout = QVBoxLayout(self)

        folder_row = QHBoxLayout()
        self.folders = QListWidget()
        self.folders.setAccessibleName("Model folders")
        self.folders.setMaximumHeight(70)
        folder_buttons = QVBoxLayout()
        self.add_button = QPushButton("Add folder…")
        self.add_button.setAccessibleName("Add model folder")
        self.remove_button = QPushButton("Remove folder")
        self.remove_button.setAccessibleName("Remove model folder")
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setAccessibleName("Refresh model library")
        for b in (self.add_button, self.remove_button, self.refresh_button):
            folder_buttons.addWidget(b)
        folder_row.addWidget(self.folders, 1)
        folder_row.addLayout(folder_buttons)
        layout.addWidget(QLabel("Folders searched for models:"))
        layout.addLayout(folder_row)

        splitter = QSplitter()
        self.table = QTableView()
        self.table.setAccessibleName("Models")
        self.table.setModel(model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.details = QTextBrowser()
        self.details.setAccessibleName("Model details")
        splitter.addWidget(self.table)
        splitter.addWidget(self.details)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([700, 300])
        layout.addWidget(splitter, 1)

        bottom = QHBoxLayout()
        bottom.addStretch(1)
        self.load_button = QPushButton("Load model")
        self.load_button.setAccessibleName("Load selected model")
        self.load_button.setEnabled(False)
        bottom.addWidget(self.load_button)
        layout.addLayout(bottom)

        self.add_button.clicked.connect(self._choose_folder)
        self.remove_button.clicked.connect(self._remove_folder)
        self.refresh_button.clicked.connect(self.refreshRequested)
        self.load_button.clicked.connect(self._load_selected)
        self.table.doubleClicked.connect(lambda _i: self._load_selected())
        self.table.selectionModel().currentRowChanged.connect(self._show_details)
        model.modelReset.connect(self._on_reset)

    def set_folders(self, folders: list[str], removable_from: int = 1) -> None:
        self.folders.clear()
        for i, folder in enumerate(folders):
            self.folders.addItem(folder if i >= removable_from else f"{folder}  (app models folder)")
        self._removable_from = removable_from

    def select_path(self, path: str) -> None:
        row = self.model.row_of(path)
        if row >= 0:
            self.table.selectRow(row)
            self._show_details(self.model.index(row, 0))

    def selected_info(self) -> ModelInfo | None:
        index = self.table.currentIndex()
        return index.data(INFO_ROLE) if index.isValid() else None

    def _on_reset(self) -> None:
        self.details.clear()
        self.load_button.setEnabled(False)

    def _show_details(self, current: QModelIndex, _previous: QModelIndex | None = None) -> None:
        if not current.isValid():
            self.details.clear()
            self.load_button.setEnabled(False)
            return
        info: ModelInfo = current.data(INFO_ROLE)
        verdict = self.model.verdict(current.row())
        self.details.setHtml(details_html(info, verdict, self.model.context_length, self.model.device))
        self.load_button.setEnabled(info.ok)

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder with models (or a model folder)")
        if folder:
            self.addFolderRequested.emit(folder)

    def _remove_folder(self) -> None:
        row = self.folders.currentRow()
        if row >= getattr(self, "_removable_from", 1):
            self.removeFolderRequested.emit(self.folders.item(row).text())

    def _load_selected(self) -> None:
        info = self.selected_info()
        if info is not None and info.ok:
            self.loadRequested.emit(str(info.path))
