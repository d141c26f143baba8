"""The settings dialog, generated from ``app.settings.schema`` (one row per visible setting)."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.settings.folders import FoldersBox
from app.settings.schema import SETTINGS, Setting
from app.settings.settings import Settings


def _editor(setting: Setting, value: Any) -> QWidget:
    if setting.choices is not None:
        box = QComboBox()
        for choice, label in setting.choices:
            box.addItem(label, choice)
        box.setCurrentIndex(max(0, box.findData(value)))
        return box
    if isinstance(setting.default, bool):
        check = QCheckBox()
        check.setChecked(bool(value))
        return check
    if isinstance(setting.default, int):
        spin = QSpinBox()
        spin.setRange(setting.minimum or 0, setting.maximum or 2**31 - 1)
        spin.setValue(int(value))
        return spin
    return QLineEdit(str(value))


def _value(widget: QWidget) -> Any:
    if isinstance(widget, QComboBox):
        return widget.currentData()
    if isinstance(widget, QCheckBox):
        return widget.isChecked()
    if isinstance(widget, QSpinBox):
        return widget.value()
    assert isinstance(widget, QLineEdit)
    return widget.text()


class SettingsDialog(QDialog):
    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.setWindowTitle("Settings")
        self.setAccessibleName("Settings")
        layout = QVBoxLayout(self)
        form = QFormLayout()
        layout.addLayout(form)
        self.editors: dict[str, QWidget] = {}
        for setting in SETTINGS:
            if setting.hidden:
                continue
            editor = _editor(setting, settings.get(setting.key))
            editor.setAccessibleName(setting.label)
            editor.setToolTip(setting.description)
            self.editors[setting.key] = editor
            form.addRow(setting.label, editor)
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
            self.settings.set(key, _value(editor))
