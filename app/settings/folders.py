"""The "Folders" box of the settings dialog: where this install keeps conversations (data), models
and logs, each with a button that opens it, so a user can back up, free space or send a log
without knowing platform conventions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QLineEdit, QPushButton, QWidget


def _open(path: Path) -> bool:
    from app.crash import open_folder

    path.mkdir(parents=True, exist_ok=True)  # a folder not created yet still opens
    return open_folder(path)


class FoldersBox(QGroupBox):
    def __init__(self, parent: QWidget | None = None, opener: Callable[[Path], bool] = _open) -> None:
        super().__init__("Folders", parent)
        from app.about import folders

        self.setAccessibleName("Folders")
        grid = QGridLayout(self)
        self.paths: dict[str, Path] = {}
        self.fields: dict[str, QLineEdit] = {}
        self.buttons: dict[str, QPushButton] = {}
        for row, (label, path) in enumerate(folders()):
            field = QLineEdit(str(path))
            field.setReadOnly(True)  # selectable and copyable, not editable: overrides are CLI flags
            field.setAccessibleName(label)
            field.setCursorPosition(0)
            # Wide enough for a typical full path (they are the point of this box), within reason.
            field.setMinimumWidth(min(520, field.fontMetrics().horizontalAdvance(str(path)) + 24))
            button = QPushButton("Open")
            button.setAccessibleName(f"Open {label.lower()}")
            button.clicked.connect(lambda _checked=False, p=path: opener(p))
            grid.addWidget(QLabel(f"{label}:"), row, 0)
            grid.addWidget(field, row, 1)
            grid.addWidget(button, row, 2)
            self.paths[label], self.fields[label], self.buttons[label] = path, field, button
        grid.setColumnStretch(1, 1)
