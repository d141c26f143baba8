"""The settings dialog, generated from ``app.settings.schema`` (one row per visible setting)."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QVBoxLayout,
    QWidget,
)

from app.settings.editors import add_schema_rows, editor_value
from app.settings.folders import FoldersBox
from app.settings.settings import Settings


class SettingsDialog(QDialog):
    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.setWindowTitle("Settings")
        self.setAccessibleName("Settings")
        layout = QVBoxLayout(self)
        form = QFormLayout()
        layout.addLayout(form)
        self.editors: dict[str, QWidget] = add_schema_rows(form, settings)
        self.folders = FoldersBox(self)  # where data, models and logs live, with "Open" buttons
        layout.addWidget(self.folders)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def accept(self) -> None:
        self.apply()
        super().accept()

    def apply(self) -> None:
        for key, editor in self.editors.items():
            self.settings.set(key, editor_value(editor))
