"""Per-conversation settings: the system prompt and the sampling preset with overrides."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.chat.presets import FIELDS, PRESET_LABELS, effective_sampling


class ConversationSettingsDialog(QDialog):
    """Shows the preset's values; whatever the user changes is stored as an override."""

    def __init__(
        self,
        system_prompt: str,
        preset: str,
        overrides: dict[str, Any],
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Conversation settings")
        self.setAccessibleName("Conversation settings")
        layout = QVBoxLayout(self)
        form = QFormLayout()
        layout.addLayout(form)

        self.system_prompt = QPlainTextEdit(system_prompt)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setMinimumHeight(100)
        form.addRow("System prompt", self.system_prompt)

        self.preset = QComboBox()
        self.preset.setAccessibleName("Sampling preset")
        for key, label in PRESET_LABELS.items():
            self.preset.addItem(label, key)
        self.preset.setCurrentIndex(max(0, self.preset.findData(preset)))
        form.addRow("Preset", self.preset)

        self.fields: dict[str, QSpinBox | QDoubleSpinBox] = {}
        for key, (label, low, high, step) in FIELDS.items():
            box: QSpinBox | QDoubleSpinBox
            if isinstance(step, int) and isinstance(low, int):
                box = QSpinBox()
                box.setRange(int(low), int(high))
                box.setSingleStep(int(step))
            else:
                box = QDoubleSpinBox()
                box.setDecimals(2)
                box.setRange(float(low), float(high))
                box.setSingleStep(float(step))
            box.setAccessibleName(label)
            self.fields[key] = box
            form.addRow(label, box)
        self._overrides = dict(overrides)
        self._show_values()
        self.preset.currentIndexChanged.connect(self._on_preset_changed)

        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def _on_preset_changed(self) -> None:
        self._overrides = {}  # a new preset starts from its own values
        self._show_values()

    def _show_values(self) -> None:
        values = effective_sampling(self.preset.currentData(), self._overrides)
        for key, box in self.fields.items():
            box.setValue(values[key])

    def result_values(self) -> tuple[str, str, dict[str, Any]]:
        """(system prompt, preset, overrides that differ from the preset)."""
        preset = self.preset.currentData()
        base = effective_sampling(preset)
        overrides = {}
        for key, box in self.fields.items():
            value = box.value()
            if abs(float(value) - float(base[key])) > 1e-9:
                overrides[key] = value
        return self.system_prompt.toPlainText(), preset, overrides
