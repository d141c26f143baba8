"""Settings shows where this install keeps data, models and logs, and opens each folder."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt

from app.crash import log_dir
from app.settings.dialog import SettingsDialog
from app.settings.folders import FoldersBox


def test_settings_dialog_shows_the_three_folders(qtbot, window, data_dir: Path) -> None:
    dialog = SettingsDialog(window.settings, window)
    qtbot.addWidget(dialog)
    fields = dialog.folders.fields
    assert fields["Data folder"].text() == str(data_dir)
    assert fields["Models folder"].text() == str(window.models_dir)
    assert fields["Logs folder"].text() == str(log_dir()) == str(data_dir / "logs")
    assert all(field.isReadOnly() for field in fields.values())


def test_open_buttons_open_the_right_folder(qtbot, data_dir: Path) -> None:
    opened: list[Path] = []
    box = FoldersBox(opener=lambda p: opened.append(p) or True)
    qtbot.addWidget(box)
    for label in ("Data folder", "Models folder", "Logs folder"):
        qtbot.mouseClick(box.buttons[label], Qt.MouseButton.LeftButton)
    assert opened == [data_dir, data_dir / "models", data_dir / "logs"]
