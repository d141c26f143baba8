"""``HubBrowserPane``: search the Hub, open a model page, pick a branch, see the memory estimate,
and queue a download. The pane is the controller between its widgets, the item models
(``app.hub.models``), ``HubController`` (network calls off the GUI thread) and the shared
``QtDownloadManager``."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFormLayout,
    QFrame,
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
from app.elided_label import ElidedLabel, never_widen
from app.empty_state import EmptyStack, EmptyState
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
        self.cancel_button = QPushButton("Cancel", self)
        self.cancel_button.setToolTip("Stop waiting for the Hub")
        self.cancel_button.hide()
        self.exl3_check = QCheckBox("EXL3 only", self)
        self.supported_check = QCheckBox("Supported architectures", self)
        self.supported_check.setChecked(True)
        self.size_combo = QComboBox(self)
        for label, *_ in SIZE_FILTERS:
            self.size_combo.addItem(label)
        self.sort_combo = QComboBox(self)
        for label, key in SORTS:
            self.sort_combo.addItem(label, key)
        self.status = ElidedLabel(parent=self)
        self.status.setAccessibleName("Hub status")
        # What went wrong (no network, the Hub refused), with a way to try again.
        self.notice = QFrame(self)
        self.notice.setFrameShape(QFrame.Shape.StyledPanel)
        self.notice_label = never_widen(QLabel(self.notice))
        self.notice_label.setAccessibleName("Hub problem")
        self.retry_button = QPushButton("Retry", self.notice)
        notice_row = QHBoxLayout(self.notice)
        notice_row.addWidget(self.notice_label, 1)
        notice_row.addWidget(self.retry_button)
        self.notice.hide()

        # -- results
        self.results = SearchResultsModel(self)
        self.results_view = QTableView(self)
        self.results_view.setModel(self.results)
        self.results_view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.results_view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        header = self.results_view.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.results_view.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.results_view.setWordWrap(False)
        self.results_view.verticalHeader().hide()

        # -- model page
        self.title = ElidedLabel(parent=self, mode=Qt.TextElideMode.ElideMiddle)
        bold = QFont(self.title.font())
        bold.setBold(True)
        self.title.setFont(bold)
        self.facts = never_widen(QLabel(self))
        self.branch_combo = QComboBox(self)
        self.context_spin = QSpinBox(self)
        self.context_spin.setRange(256, 1 << 20)
        self.context_spin.setSingleStep(1024)
        self.context_spin.setValue(8192)
        self.memory_label = never_widen(QLabel(self))
        self.download_button = QPushButton("Download", self)
        self.download_button.setEnabled(False)
        self.card = QTextBrowser(self)
        self.card.setOpenExternalLinks(True)
        self.files = FilesModel(self)
        self.files_view = QTableView(self)
        self.files_view.setModel(self.files)
        files_header = self.files_view.horizontalHeader()
        files_header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        files_header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.files_view.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.files_view.verticalHeader().hide()
        self.page_tabs = QTabWidget(self)
        self.page_tabs.addTab(self.card, "Model card")
        self.page_tabs.addTab(self.files_view, "Files")

        top = QHBoxLayout()
        top.addWidget(self.search_edit, 1)
        top.addWidget(self.search_button)
        top.addWidget(self.cancel_button)
        filters = QHBoxLayout()
        for w in (self.exl3_check, self.supported_check, self.size_combo, self.sort_combo):
            filters.addWidget(w)
        filters.addSpacing(12)
        filters.addWidget(self.status, 1)

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
        # The results get room for their names (the other columns take what their text needs).
        splitter.setStretchFactor(0, 1)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([560, 440])
        # Before the first search, and when a search finds nothing: say what to do next.
        self.empty = EmptyState(
            "Discover models",
            "Search the Hugging Face Hub for a model to run here: type a name such as SmolLM2, "
            "Qwen3 or Llama and press Enter. Open a result to see its files, the memory it needs "
            "and its branches, then download it.",
            "Show popular models",
        )
        self.empty.actionRequested.connect(self._empty_action)
        self.stack = EmptyStack(splitter, self.empty)
        self.stack.set_empty(True)
        self.results_were_empty = False  # no search has answered yet
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addLayout(filters)
        layout.addWidget(self.notice)
        layout.addWidget(self.stack, 1)

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
        controller.busyChanged.connect(self._on_busy)
        self.cancel_button.clicked.connect(self.cancel)
        self.retry_button.clicked.connect(self.retry)

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
        self.notice.hide()
        self.status.setText("Searching the Hub…")
        self.controller.search(self.query())

    def open_model(self, repo_id: str, revision: str = "main") -> None:
        self.notice.hide()
        self.download_button.setEnabled(False)
        self.title.setText(repo_id)
        self.facts.setText("Fetching the model page…")
        self.controller.open_model(repo_id, revision)

    def cancel(self) -> None:
        """Stop waiting for the Hub (the Cancel button)."""
        if self.controller.busy:
            self.controller.cancel()
            self.status.setText("Cancelled")
            if self.page is None:
                self.facts.setText("")

    def retry(self) -> None:
        """Send the request that failed again (the Retry button)."""
        self.notice.hide()
        self.status.setText("Trying again…")
        self.controller.retry()

    def _on_busy(self, busy: bool) -> None:
        self.cancel_button.setVisible(busy)

    def start_download(self) -> str | None:
        if self.page is None:
            return None
        d = self.page.details
        job_id = self.downloads.enqueue(d.repo_id, d.revision)
        self.status.setText(f"Queued {d.repo_id} ({d.revision}) for download")
        return job_id

    # -- results from the controller ---------------------------------------------------------------

    def _show_results(self, hits: list) -> None:
        self.notice.hide()
        self.results.set_rows(hits)
        self.status.setText(f"{len(hits)} models" if hits else "No models found")
        if not hits:
            text = self.search_edit.text().strip()
            self.empty.set_message(
                f"No models match “{text}”" if text else "No models match these filters",
                "Check the spelling, try a shorter name, or loosen the filters (Supported "
                "architectures, EXL3 only, size).",
                "Clear filters",
            )
        self.results_were_empty = not hits
        self.stack.set_empty(not hits)

    def _empty_action(self) -> None:
        """The empty state's button: before a search, list popular models; after a search that
        found nothing, clear the filters and search again."""
        if self.results_were_empty:
            self.clear_filters()
        else:
            self.run_search()

    def clear_filters(self) -> None:
        """Every filter off (one search, not one per filter changed)."""
        widgets = (self.exl3_check, self.supported_check, self.size_combo)
        for widget in widgets:
            widget.blockSignals(True)
        self.exl3_check.setChecked(False)
        self.supported_check.setChecked(False)
        self.size_combo.setCurrentIndex(0)
        for widget in widgets:
            widget.blockSignals(False)
        self.run_search()

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
        self.notice.hide()
        d = page.details
        self.title.setText(f"{d.repo_id} @ {d.revision}")
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
        """In the pane, wrapped, with a Retry button; the status line says it in one word (the
        message is its tooltip). No message can widen the window."""
        self.status.setText("Offline" if self.controller.offline else "Error")
        self.status.setToolTip(message)
        self.notice_label.setText(message)
        self.notice.show()
        if self.page is None:
            self.facts.setText("")
