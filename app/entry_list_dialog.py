"""A dialog that edits a list of entries kept in the settings (Settings › Engines, Settings › Tools):
what the list is for, the list itself, a form for a new entry, Add and Remove, a status line that
says what happened, and Close.

Subclasses say what an entry is: ``add`` (called with the form's texts, in field order) and
``remove_selected``; they may put more buttons in ``button_row`` and more widgets above the status
line (``add_section``).
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPushButton,
    QVBoxLayout,
    QWidget,
)


@dataclass(frozen=True)
class EntryField:
    """One line of the new-entry form: its label, the name a screen reader says, a hint shown
    while it is empty, and whether it hides what is typed (a key)."""

    label: str
    accessible_name: str
    placeholder: str = ""
    secret: bool = False


class EntryListDialog(QDialog):
    def __init__(
        self,
        title: str,
        intro: str,
        list_name: str,
        fields: tuple[EntryField, ...],
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        self._layout = QVBoxLayout(self)
        self._layout.addWidget(QLabel(intro))
        self.entries = QListWidget()
        self.entries.setAccessibleName(list_name)
        self._layout.addWidget(self.entries)
        form = QFormLayout()
        self.fields: list[QLineEdit] = []
        for field in fields:
            edit = QLineEdit()
            edit.setAccessibleName(field.accessible_name)
            if field.placeholder:
                edit.setPlaceholderText(field.placeholder)
            if field.secret:
                edit.setEchoMode(QLineEdit.EchoMode.Password)
            form.addRow(field.label, edit)
            self.fields.append(edit)
        self._layout.addLayout(form)
        self.button_row = QHBoxLayout()
        self.add_button = QPushButton("Add")
        self.remove_button = QPushButton("Remove")
        self.button_row.addWidget(self.add_button)
        self.button_row.addWidget(self.remove_button)
        self._layout.addLayout(self.button_row)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self._layout.addWidget(self.status)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        self._layout.addWidget(buttons)
        self.add_button.clicked.connect(lambda: self.add(*(edit.text() for edit in self.fields)))
        self.remove_button.clicked.connect(self.remove_selected)

    def add_section(self, widget: QWidget) -> None:
        """Place ``widget`` below the buttons, above the status line."""
        self._layout.insertWidget(self._layout.indexOf(self.status), widget)

    def clear_fields(self) -> None:
        for edit in self.fields:
            edit.clear()

    def add(self, *texts: str) -> bool:
        """Add the entry the form describes; False, with the reason in ``status``, when it cannot."""
        raise NotImplementedError

    def remove_selected(self) -> None:
        raise NotImplementedError
