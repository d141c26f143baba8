"""The library pane: folders, the table of models, details of the selected one (with the reasons
a broken model cannot load), the folders that hold no model (dimmed, apart), the load options,
and Load / Show in folder / Delete for the selected model. With no model at all it says how to get
one: "Download a model" (the window opens Discover) or a folder of models."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QModelIndex, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QMessageBox,
    QPushButton,
    QSplitter,
    QTableView,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.elided_label import ElidedLabel
from app.empty_state import EmptyStack, EmptyState
from app.library.load_options import LoadOptions
from app.library.model import INFO_ROLE, LibraryModel
from app.library.placement import advise, estimate_split, split_text
from app.theme import ERROR_COLORS
from engine.inspect import MemoryVerdict, ModelInfo
from engine.placement_memory import MemorySplit
from engine.units import format_bytes, format_count


def details_html(
    info: ModelInfo,
    verdict: MemoryVerdict | None,
    context_length: int,
    device: str = "cpu",
    error_color: str = ERROR_COLORS[0],
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
        out += f"<p style='color:{error_color};'><b>This model cannot be loaded:</b></p><ul>{items}</ul>"
    return out


class LibraryPane(QWidget):
    loadRequested = Signal(str)
    addFolderRequested = Signal(str)
    removeFolderRequested = Signal(str)
    refreshRequested = Signal()
    deleteRequested = Signal(str)  # a model folder; the user has confirmed
    showInFolderRequested = Signal(str)
    discoverRequested = Signal()  # the empty library's "Download a model"

    def __init__(self, model: LibraryModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.error_color = ERROR_COLORS[0]
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
        # Every column but the name as wide as its contents; the name takes the rest, elided in
        # the middle (the ends of a model's name tell it apart), so no column is cut off.
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setMinimumSectionSize(60)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.details = QTextBrowser()
        self.details.setAccessibleName("Model details")
        splitter.addWidget(self.table)
        splitter.addWidget(self.details)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([720, 260])
        self.empty = EmptyState(
            "No models yet",
            "Download a model from Discover, or add a folder that already holds models "
            "(Add folder… above). Models in these folders are listed here.",
            "Download a model",
        )
        self.empty.actionRequested.connect(self.discoverRequested)
        self.stack = EmptyStack(splitter, self.empty)
        layout.addWidget(self.stack, 1)

        # Folders that were looked at and hold no model: said apart, dimmed, not as model rows.
        self.not_models = ElidedLabel()
        self.not_models.setAccessibleName("Folders that are not models")
        self.not_models.setProperty("role", "muted")
        self.not_models.hide()
        layout.addWidget(self.not_models)

        self.load_options = LoadOptions(self)
        layout.addWidget(self.load_options)
        self._placed_for: str | None = None  # the model the automatic placement was chosen for

        bottom = QHBoxLayout()
        self.show_button = QPushButton("Show in folder")
        self.show_button.setAccessibleName("Show the selected model in its folder")
        self.delete_button = QPushButton("Delete…")
        self.delete_button.setAccessibleName("Delete the selected model")
        self.load_button = QPushButton("Load model")
        self.load_button.setAccessibleName("Load selected model")
        for button in (self.show_button, self.delete_button, self.load_button):
            button.setEnabled(False)
        bottom.addWidget(self.show_button)
        bottom.addWidget(self.delete_button)
        bottom.addStretch(1)
        bottom.addWidget(self.load_button)
        layout.addLayout(bottom)

        self.add_button.clicked.connect(self._choose_folder)
        self.remove_button.clicked.connect(self._remove_folder)
        self.refresh_button.clicked.connect(self.refreshRequested)
        self.load_button.clicked.connect(self._load_selected)
        self.show_button.clicked.connect(self._show_selected)
        self.delete_button.clicked.connect(self.delete_selected)
        self.table.doubleClicked.connect(lambda _i: self._load_selected())
        self.table.selectionModel().currentRowChanged.connect(self._show_details)
        model.modelReset.connect(self._on_reset)
        self.stack.set_empty(model.rowCount() == 0)
        # The estimates changed (context, cache widths, device): the details say them too.
        model.dataChanged.connect(lambda *_: self._show_details(self.table.currentIndex()))
        self.load_options.placementChosen.connect(lambda: self._show_details(self.table.currentIndex()))

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

    def set_not_models(self, folders: list[tuple[str, str]]) -> None:
        """The folders that hold no model, and why (shown dimmed, apart from the models)."""
        if not folders:
            self.not_models.hide()
            return
        shown = "; ".join(f"{Path(path).name} ({why})" for path, why in folders)
        self.not_models.setText(f"Not models, not listed: {shown}")
        self.not_models.setToolTip("\n".join(f"{path}: {why}" for path, why in folders))
        self.not_models.show()

    def set_error_color(self, color: str) -> None:
        """The theme's colour for problems (the details' "cannot be loaded")."""
        self.error_color = color
        self._show_details(self.table.currentIndex())

    def _on_reset(self) -> None:
        self.stack.set_empty(self.model.rowCount() == 0)
        self.details.clear()
        self.load_options.set_estimate("Select a model to see the memory it needs.")
        for button in (self.show_button, self.delete_button, self.load_button):
            button.setEnabled(False)

    def _show_details(self, current: QModelIndex, _previous: QModelIndex | None = None) -> None:
        if not current.isValid():
            self._on_reset()
            return
        info: ModelInfo = current.data(INFO_ROLE)
        verdict = self.model.verdict(current.row())
        context = self.model.context_for(info)
        self.details.setHtml(details_html(info, verdict, context, self.model.device, self.error_color))
        if info.ok:
            estimate = (
                f"{info.name}: ≈ {format_bytes(verdict.needed_bytes)} at {context:,} tokens "
                f"({verdict.verdict}, {format_bytes(verdict.available_bytes)} free)"
            )
            split = self._place(info, context)
            self.load_options.set_estimate(estimate if split is None else f"{estimate}; {split_text(split)}")
        else:
            self.load_options.set_estimate(f"{info.name} cannot be loaded (see its details).")
        self.load_button.setEnabled(info.ok)
        self.show_button.setEnabled(True)
        self.delete_button.setEnabled(True)

    def refresh_placement(self) -> None:
        """Choose where the selected model runs again (the GPU the choice depends on changed)."""
        self._placed_for = None
        self._show_details(self.table.currentIndex())

    def _place(self, info: ModelInfo, context: int) -> MemorySplit | None:
        """Where the model runs, where that is offered: chosen automatically when another model is
        selected (kept as the user changes it after), and the split of its memory between the GPU
        and system memory (None: all on the GPU)."""
        options = self.load_options
        if not options.placement_offered():
            return None
        options.set_layer_count(info.num_layers)
        if self._placed_for != str(info.path):
            self._placed_for = str(info.path)
            advice = advise(
                info,
                context,
                self.model.cache_bits,
                options.gpu_memory_bytes,
                options.gpu_memory_free,
                options.gpu_memory[1:],
            )
            options.set_placement(advice.placement, advice.gpu_layers, advice.reason)
        return estimate_split(info, context, self.model.cache_bits, *options.current_placement())

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

    def _show_selected(self) -> None:
        info = self.selected_info()
        if info is not None:
            self.showInFolderRequested.emit(str(info.path))

    def delete_selected(self) -> None:
        """Ask, then ask the controller to delete the selected model's folder from disk."""
        info = self.selected_info()
        if info is None:
            return
        answer = QMessageBox.question(
            self,
            "Delete model",
            f"Delete {info.name} ({format_bytes(info.size_bytes)}) from disk?\n\n{info.path}\n\n"
            "This cannot be undone.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        if answer == QMessageBox.StandardButton.Yes:
            self.deleteRequested.emit(str(info.path))
