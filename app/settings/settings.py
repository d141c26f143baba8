"""Settings with change notification, persisted in the store's settings table."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, Signal

from app.settings.schema import BY_KEY
from app.store import Store


class Settings(QObject):
    """Typed access to the values declared in ``app.settings.schema``; GUI thread only."""

    changed = Signal(str, object)  # key, new value

    def __init__(self, store: Store, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._store = store

    def get(self, key: str) -> Any:
        setting = BY_KEY[key]
        return setting.validate(self._store.get_setting(key, setting.default))

    def set(self, key: str, value: Any) -> None:
        value = BY_KEY[key].validate(value)
        if value == self.get(key):
            return
        self._store.set_setting(key, value)
        self.changed.emit(key, value)
