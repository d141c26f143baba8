"""The Settings pane of the navigation rail: the same schema-generated form as the settings dialog,
applied as each value changes (no OK button to forget), plus the ways to the remote engines and
MCP tools dialogs, the folders where the app keeps its data, and the GPU runtime (``gpu_runtime``)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app import paths
from app.runtime.activate import runtime_root
from app.settings.editors import add_schema_rows, editor_value, set_editor_value
from app.settings.folders import FoldersBox
from app.settings.gpu_runtime import GpuRuntimeBox
from app.settings.settings import Settings
from app.theme import SPACE_L, SPACE_M, SPACE_XL, font_for

# The form's widest: label and editor stay close together on a wide window.
FORM_WIDTH = 720


class SettingsPage(QScrollArea):
    enginesRequested = Signal()
    toolsRequested = Signal()

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.setAccessibleName("Settings")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        body = QWidget()
        body.setMaximumWidth(FORM_WIDTH)
        column = QVBoxLayout(body)
        column.setContentsMargins(SPACE_XL, SPACE_XL, SPACE_XL, SPACE_XL)
        column.setSpacing(SPACE_L)
        title = QLabel("Settings")
        title.setFont(font_for("display", title.font()))
        note = QLabel("Changes apply at once.")
        note.setProperty("role", "muted")
        column.addWidget(title)
        column.addWidget(note)

        form = QFormLayout()
        form.setHorizontalSpacing(SPACE_L)
        form.setVerticalSpacing(SPACE_M)
        self.editors: dict[str, QWidget] = add_schema_rows(form, settings)
        for key, editor in self.editors.items():
            self._on_edit(editor, lambda key=key: self._apply(key))
        column.addLayout(form)

        more = QHBoxLayout()
        self.engines_button = QPushButton("Remote engines…")
        self.engines_button.setAccessibleName("Remote engines")
        self.tools_button = QPushButton("Tools (MCP servers)…")
        self.tools_button.setAccessibleName("Tools (MCP servers)")
        more.addWidget(self.engines_button)
        more.addWidget(self.tools_button)
        more.addStretch(1)
        column.addLayout(more)
        self.folders = FoldersBox(body)
        column.addWidget(self.folders)
        self.gpu_runtime = GpuRuntimeBox(runtime_root(paths.data_dir()), body)
        column.addWidget(self.gpu_runtime)
        column.addStretch(1)
        outer = QWidget()
        row = QHBoxLayout(outer)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(body, 1, Qt.AlignmentFlag.AlignLeft)
        self.setWidget(outer)

        self.engines_button.clicked.connect(self.enginesRequested)
        self.tools_button.clicked.connect(self.toolsRequested)
        settings.changed.connect(self._on_changed)  # changed elsewhere (the dialog, a test)

    @staticmethod
    def _on_edit(editor: QWidget, apply) -> None:
        """Apply when a value is chosen: at once for choices and switches, when editing ends for
        numbers and text (not on every keystroke)."""
        if isinstance(editor, QComboBox):
            editor.activated.connect(lambda _i: apply())
        elif isinstance(editor, QCheckBox):
            editor.toggled.connect(lambda _on: apply())
        elif isinstance(editor, (QSpinBox, QLineEdit)):
            editor.editingFinished.connect(apply)

    def _apply(self, key: str) -> None:
        value = editor_value(self.editors[key])
        if value != self.settings.get(key):
            self.settings.set(key, value)

    def _on_changed(self, key: str, value: Any) -> None:
        editor = self.editors.get(key)
        if editor is not None and editor_value(editor) != value:
            set_editor_value(editor, value)
