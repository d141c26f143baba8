"""``HubBrowserPane``: search the Hub, open a model page, pick a branch, see the memory estimate,
and queue a download. The pane is the controller between its widgets, the item models
(``app.hub.models``), ``HubController`` (network calls off the GUI thread) and the shared
``QtDownloadManager``."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableView,
    QTabWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.downloads.qt_manager import QtDownloadManager
from app.hub.controller import HubController, ModelPage
from app.hub.models import SUMMARY_ROLE, FilesModel, SearchResultsModel
from engine.hub.client import SearchQuery
from engine.hub.memory import max_context
from engine.units import format_bytes, format_count

# (label, min params, max params)
SIZE_FILTERS: tuple[tuple[str, float | None, float | None], ...] = (
    ("Any size", None, None),
    ("Up to 4B", None, 4e9),
    ("4B to 10B", 4e9, 10e9),
    ("10B to 35B", 10e9, 35e9),
    ("Over 35B", 35e9, None),
)
SORTS: tuple[tuple[str, str], ...] = (
    ("Most downloads", "downloads"),
    ("Most likes", "likes"),
    ("Recently updated", "updated"),
    ("Newest", "created"),
    ("Trending", "trending"),
)


class HubBrowserPane(QWidget):
    def __init__(
        self, controller: HubController, download_manager: QtDownloadManager, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.controller = controller
        self.downloads = download_manager
        self.page: ModelPage | None = None

        # -- search bar and filters
        self.search_edit = QLineEdit(self)
        self.search_edit.setPlaceholderText("Search models on the Hugging Face Hub")
        self.search_button = QPushButton("Search", self)
        self.exl3_check = QCheckBox("EXL3 only", self)
        self.supported_check = QCheckBox("Supported architectures", self)
        self.supported_check.setChecked(True)
        self.size_combo = QComboBox(self)
        for label, *_ in SIZE_FILTERS:
            self.size_combo.addItem(label)
        self.sort_combo = QComboBox(self)
        for label, key in SORTS:
            self.sort_combo.addItem(label, key)
        self.status = QLabel(self)

        # -- results
        self.results = SearchResultsModel(self)
        self.results_view = QTableView(self)
        self.results_view.setModel(self.results)
        self.results_view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.results_view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.results_view.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.results_view.verticalHeader().hide()

        # -- model page
        self.title = QLabel(self)
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.facts = QLabel(self)
        self.facts.setWordWrap(True)
        self.branch_combo = QComboBox(self)
        self.context_spin = QSpinBox(self)
        self.context_spin.setRange(256, 1 << 20)
        self.context_spin.setSingleStep(1024)
        self.context_spin.setValue(8192)
        self.memory_label = QLabel(self)
        self.memory_label.setWordWrap(True)
        self.download_button = QPushButton("Download", self)
        self.download_button.setEnabled(False)
        self.card = QTextBrowser(self)
        self.card.setOpenExternalLinks(True)
        self.files = FilesModel(self)
        self.files_view = QTableView(self)
        self.files_view.setModel(self.files)
        self.files_view.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.files_view.verticalHeader().hide()
        self.page_tabs = QTabWidget(self)
        self.page_tabs.addTab(self.card, "Model card")
        self.page_tabs.addTab(self.files_view, "Files")

        top = QHBoxLayout()
        top.addWidget(self.search_edit, 1)
        top.addWidget(self.search_button)
        filters = QHBoxLayout()
        for w in (self.exl3_check, self.supported_check, self.size_combo, self.sort_combo):
            filters.addWidget(w)
        filters.addStretch(1)
        filters.addWidget(self.status)

        page = QWidget(self)
        form = QFormLayout()
        form.addRow("Branch", self.branch_combo)
        form.addRow("Context length", self.context_spin)
        form.addRow("Memory", self.memory_label)
        page_layout = QVBoxLayout(page)
        page_layout.addWidget(self.title)
        page_layout.addWidget(self.facts)
        page_layout.addLayout(form)
        page_layout.addWidget(self.download_button)
        page_layout.addWidget(self.page_tabs, 1)

        splitter = QSplitter(self)
        splitter.addWidget(self.results_view)
        splitter.addWidget(page)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addLayout(filters)
        layout.addWidget(splitter, 1)

        # -- wiring
        self.search_edit.returnPressed.connect(self.run_search)
        self.search_button.clicked.connect(self.run_search)
        for combo in (self.size_combo, self.sort_combo):
            combo.currentIndexChanged.connect(self.run_search)
        for check in (self.exl3_check, self.supported_check):
            check.toggled.connect(self.run_search)
        self.results_view.selectionModel().currentRowChanged.connect(self._open_selected)
        self.branch_combo.activated.connect(self._branch_chosen)
        self.context_spin.valueChanged.connect(self._update_estimate)
        self.download_button.clicked.connect(self.start_download)
        controller.searchFinished.connect(self._show_results)
        controller.pageReady.connect(self._show_page)
        controller.failed.connect(self._show_error)
        controller.busyChanged.connect(
            lambda busy: self.status.setText("Loading…" if busy else self.status.text())
        )

    # -- actions -----------------------------------------------------------------------------------

    def query(self) -> SearchQuery:
        _, lo, hi = SIZE_FILTERS[self.size_combo.currentIndex()]
        return SearchQuery(
            text=self.search_edit.text().strip(),
            exl3=self.exl3_check.isChecked(),
            supported_only=self.supported_check.isChecked(),
            min_params=lo,
            max_params=hi,
            sort=self.sort_combo.currentData(),
        )

    def run_search(self) -> None:
        self.status.setText("Searching…")
        self.controller.search(self.query())

    def open_model(self, repo_id: str, revision: str = "main") -> None:
        self.download_button.setEnabled(False)
        self.title.setText(f"<b>{repo_id}</b>")
        self.facts.setText("Loading…")
        self.controller.open_model(repo_id, revision)

    def start_download(self) -> str | None:
        if self.page is None:
            return None
        d = self.page.details
        job_id = self.downloads.enqueue(d.repo_id, d.revision)
        self.status.setText(f"Queued {d.repo_id} ({d.revision}) for download")
        return job_id

    # -- results from the controller ---------------------------------------------------------------

    def _show_results(self, hits: list) -> None:
        self.results.set_rows(hits)
        self.status.setText(f"{len(hits)} models" if hits else "No models found")

    def _open_selected(self, current, previous) -> None:
        if current.isValid():
            hit = self.results.index(current.row(), 0).data(SUMMARY_ROLE)
            self.open_model(hit.repo_id)

    def _branch_chosen(self, index: int) -> None:
        if self.page is not None:
            branch = self.branch_combo.itemText(index)
            if branch != self.page.details.revision:
                self.open_model(self.page.details.repo_id, branch)

    def _show_page(self, page: ModelPage) -> None:
        previous = self.page
        self.page = page
        d = page.details
        self.title.setText(f"<b>{d.repo_id}</b> @ {d.revision}")
        gated = {False: "no", "auto": "yes (automatic approval)", "manual": "yes (manual approval)"}.get(
            d.gated, "yes"
        )
        facts = [
            f"Licence: {d.license or 'not stated'}",
            f"Gated: {gated}",
            f"Files: {len(d.files)}, {format_bytes(d.total_size)}",
        ]
        if d.params:
            facts.append(f"Parameters: {format_count(d.params)}")
        facts.append(f"Downloads: {d.downloads:,}, likes: {d.likes:,}")
        self.facts.setText(" · ".join(facts))
        # Branches come with the first page of a repo; a branch switch keeps the list.
        branches = [b.name for b in d.branches] or (
            [self.branch_combo.itemText(i) for i in range(self.branch_combo.count())]
            if previous is not None and previous.details.repo_id == d.repo_id
            else [d.revision]
        )
        self.branch_combo.blockSignals(True)
        self.branch_combo.clear()
        self.branch_combo.addItems(branches)
        self.branch_combo.setCurrentText(d.revision)
        self.branch_combo.blockSignals(False)
        self.card.setMarkdown(page.card or "*This model has no model card.*")
        self.files.set_rows(list(d.files))
        limit = max_context(page.config or {})
        self.context_spin.setMaximum(limit or (1 << 20))
        self._update_estimate()
        self.download_button.setEnabled(True)

    def _update_estimate(self, *args) -> None:
        if self.page is None:
            return
        est = self.controller.estimate(self.page, self.context_spin.value())
        self.memory_label.setText(est.describe())

    def _show_error(self, message: str) -> None:
        self.status.setToolTip(message)
        self.status.setText(f"Error: {message[:120]}")
        if self.page is None:
            self.facts.setText(message)
