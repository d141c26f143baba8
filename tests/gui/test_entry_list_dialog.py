"""The list-editing dialog under Settings › Engines and Settings › Tools: its form, its buttons and
where a subclass's extra widgets go."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QLineEdit

from app.entry_list_dialog import EntryField, EntryListDialog


class Recording(EntryListDialog):
    def __init__(self) -> None:
        super().__init__(
            "Things",
            "The things.",
            "Things list",
            (EntryField("Name", "Thing name", "e.g. cup"), EntryField("Secret", "Thing secret", secret=True)),
        )
        self.added: list[tuple[str, ...]] = []
        self.removed = 0

    def add(self, *texts: str) -> bool:
        self.added.append(texts)
        self.clear_fields()
        return True

    def remove_selected(self) -> None:
        self.removed += 1


def test_the_form_follows_its_fields_and_add_passes_their_texts_in_order(qtbot):
    dialog = Recording()
    qtbot.addWidget(dialog)
    name, secret = dialog.fields
    assert (name.accessibleName(), name.placeholderText()) == ("Thing name", "e.g. cup")
    assert name.echoMode() == QLineEdit.EchoMode.Normal
    assert secret.echoMode() == QLineEdit.EchoMode.Password
    assert dialog.entries.accessibleName() == "Things list" and dialog.windowTitle() == "Things"
    name.setText("cup")
    secret.setText("s3")
    qtbot.mouseClick(dialog.add_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(dialog.remove_button, Qt.MouseButton.LeftButton)
    assert dialog.added == [("cup", "s3")] and dialog.removed == 1
    assert name.text() == secret.text() == ""


def test_a_section_goes_below_the_buttons_and_above_the_status_line(qtbot):
    dialog = Recording()
    qtbot.addWidget(dialog)
    extra = QLabel("more")
    dialog.add_section(extra)
    layout = dialog.layout()
    buttons_at = next(i for i in range(layout.count()) if layout.itemAt(i).layout() is dialog.button_row)
    assert buttons_at < layout.indexOf(extra) == layout.indexOf(dialog.status) - 1
