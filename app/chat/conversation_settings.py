"""Per-conversation settings: the system prompt, the structured-output JSON schema, and the
sampling preset with overrides."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.chat.presets import FIELDS, PRESET_LABELS, TOOLTIPS, effective_sampling
from app.chat.structured import schema_problem


class ConversationSettingsDialog(QDialog):
    """Shows the preset's values; whatever the user changes is stored as an override."""

    def __init__(
        self,
        system_prompt: str,
        preset: str,
        overrides: dict[str, Any],
        parent: QWidget | None = None,
        json_schema: str = "",
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

        self.json_schema = QPlainTextEdit(json_schema)
        self.json_schema.setAccessibleName("Structured output (JSON schema)")
        self.json_schema.setPlaceholderText(
            'Empty: free text. Paste a JSON schema, e.g. {"type": "object", "properties": '
            '{"answer": {"type": "string"}}, "required": ["answer"]}, and every reply will be '
            "JSON valid under it."
        )
        self.json_schema.setMinimumHeight(80)
        form.addRow("Structured output (JSON schema)", self.json_schema)
        # Shown in the dialog (not a message box) so the user can fix the schema where it is.
        self.schema_error = QLabel()
        self.schema_error.setAccessibleName("JSON schema error")
        self.schema_error.setWordWrap(True)
        self.schema_error.setStyleSheet("color: #c0392b;")
        self.schema_error.hide()
        form.addRow("", self.schema_error)

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
            box.setToolTip(TOOLTIPS.get(key, ""))
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

    def accept(self) -> None:
        """Save only a schema the engine will accept; otherwise say why and stay open."""
        problem = schema_problem(self.json_schema.toPlainText())
        if problem:
            self.schema_error.setText(problem)
            self.schema_error.show()
            self.json_schema.setFocus()
            return
        self.schema_error.hide()
        super().accept()

    def json_schema_text(self) -> str:
        """The structured-output schema as typed ("" = free text)."""
        return self.json_schema.toPlainText().strip()

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
