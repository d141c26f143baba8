"""Settings › Engines: the OpenAI-compatible endpoints whose models the picker offers.

An endpoint is its base URL (kept in the settings) and an optional API key (kept in the system
keyring under that URL; the field shows whether one is stored, never the key itself).
"""

from __future__ import annotations

from PySide6.QtWidgets import QPushButton, QWidget

from app.entry_list_dialog import EntryField, EntryListDialog
from app.remote.catalog import RemoteCatalog
from app.remote.keys import KeyringUnavailable, delete_key, get_key, set_key
from app.remote.refs import normalize_base_url
from app.settings.settings import Settings

SETTING = "remote.endpoints"

FIELDS = (
    EntryField("Base URL", "Base URL", "http://127.0.0.1:8000/v1"),
    EntryField("API key", "API key", "optional; kept in the system keyring", secret=True),
)


class EnginesDialog(EntryListDialog):
    def __init__(self, settings: Settings, catalog: RemoteCatalog, parent: QWidget | None = None) -> None:
        super().__init__(
            "Remote engines",
            "OpenAI-compatible servers (vLLM, llama.cpp's llama-server, SGLang, TabbyAPI, Ollama, "
            "another Trellis Chat): their models appear in the model picker.",
            "Endpoints",
            FIELDS,
            parent,
        )
        self.settings, self.catalog = settings, catalog
        self.setAccessibleName("Remote engines")
        self.status.setAccessibleName("Engines status")
        self.list = self.entries
        self.url, self.key = self.fields
        self.refresh_button = QPushButton("Refresh models")
        self.button_row.addWidget(self.refresh_button)
        self.refresh_button.clicked.connect(self.refresh)
        catalog.refreshed.connect(self._show_models)
        catalog.endpointFailed.connect(lambda url, why: self.status.setText(f"{url}: {why}"))
        self._fill()

    def endpoints(self) -> list[str]:
        return list(self.settings.get(SETTING))

    def _fill(self) -> None:
        self.list.clear()
        for url in self.endpoints():
            self.list.addItem(url)

    def add(self, url: str, key: str = "") -> bool:
        """Add (or update the key of) an endpoint; False, with the reason shown, when it cannot."""
        try:
            url = normalize_base_url(url)
        except ValueError as exc:
            self.status.setText(str(exc))
            return False
        try:
            if key:
                set_key(url, key)
        except KeyringUnavailable as exc:
            self.status.setText(f"{exc}. The endpoint was not added.")
            return False
        endpoints = self.endpoints()
        if url not in endpoints:
            self.settings.set(SETTING, [*endpoints, url])
        self.clear_fields()
        self._fill()
        self.status.setText(
            f"Added {url}{' (API key stored in the keyring)' if key else ''}; listing its models…"
        )
        self.refresh()
        return True

    def remove_selected(self) -> None:
        item = self.list.currentItem()
        if item is None:
            return
        url = item.text()
        delete_key(url)
        self.settings.set(SETTING, [u for u in self.endpoints() if u != url])
        self._fill()
        self.refresh()

    def refresh(self) -> None:
        self.catalog.refresh(self.endpoints())

    def _show_models(self) -> None:
        counts = [f"{url}: {len(ids)} model(s)" for url, ids in self.catalog.listed.items()]
        if counts:
            self.status.setText("; ".join(counts))

    def has_key(self, url: str) -> bool:
        return get_key(url) is not None
