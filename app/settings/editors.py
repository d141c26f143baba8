"""One editor widget per kind of setting (a choice, a switch, a number, a text), and reading its value
back: shared by the settings dialog and the settings pane, both generated from the schema."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QCheckBox, QComboBox, QFormLayout, QLineEdit, QSpinBox, QWidget

from app.settings.schema import SETTINGS, Setting
from app.settings.settings import Settings


def editor_for(setting: Setting, value: Any) -> QWidget:
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


def editor_value(widget: QWidget) -> Any:
    if isinstance(widget, QComboBox):
        return widget.currentData()
    if isinstance(widget, QCheckBox):
        return widget.isChecked()
    if isinstance(widget, QSpinBox):
        return widget.value()
    assert isinstance(widget, QLineEdit)
    return widget.text()


def set_editor_value(widget: QWidget, value: Any) -> None:
    """Show ``value`` in ``widget`` without emitting its change signals."""
    blocked = widget.blockSignals(True)
    if isinstance(widget, QComboBox):
        widget.setCurrentIndex(max(0, widget.findData(value)))
    elif isinstance(widget, QCheckBox):
        widget.setChecked(bool(value))
    elif isinstance(widget, QSpinBox):
        widget.setValue(int(value))
    elif isinstance(widget, QLineEdit):
        widget.setText(str(value))
    widget.blockSignals(blocked)


def add_schema_rows(form: QFormLayout, settings: Settings) -> dict[str, QWidget]:
    """One labelled row in ``form`` per visible setting of the schema, showing its current value
    (accessible name: its label; tooltip: its description); returns the editors by key."""
    editors: dict[str, QWidget] = {}
    for setting in SETTINGS:
        if setting.hidden:
            continue
        editor = editor_for(setting, settings.get(setting.key))
        editor.setAccessibleName(setting.label)
        editor.setToolTip(setting.description)
        editors[setting.key] = editor
        form.addRow(setting.label, editor)
    return editors
