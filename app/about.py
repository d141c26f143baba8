"""The About dialog: which Trellis Chat this is, on which runtime, on which GPU.

It is also the page a user copies into a bug report, so the versions are plain text rows with a
"Copy" button. torch is the one slow import (seconds on a cold disk); the dialog opens at once
with the rows known without it, and fills in torch, CUDA and the GPU from
:class:`app.gpu_check.GpuCheck`, which runs on a background thread (or from the report the startup
check already made).
"""

from __future__ import annotations

import platform
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import PySide6
from PySide6.QtCore import Qt, qVersion
from PySide6.QtGui import QGuiApplication, QIcon
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app import gpu_check
from engine.units import format_bytes

APP_TITLE = "Trellis Chat"
ICON_NAME = "trellis-chat"


def app_version() -> str:
    try:
        return metadata.version("trellis-chat")
    except metadata.PackageNotFoundError:  # a checkout run without pip install: ask pyproject
        try:
            with open(resources_dir().parent / "pyproject.toml", "rb") as f:
                return str(tomllib.load(f)["project"]["version"]) + " (source tree)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def resources_dir() -> Path:
    """``resources/``: beside ``app/`` in a checkout, inside the bundle when frozen."""
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        return Path(bundle) / "resources"
    return Path(__file__).resolve().parents[1] / "resources"


def app_icon() -> QIcon:
    """The app icon: the installed theme icon when the desktop entry put one there, else ours."""
    icon = QIcon.fromTheme(ICON_NAME)
    if icon.isNull():
        icon = QIcon()
        for png in sorted(resources_dir().glob("icons/hicolor/*/apps/trellis-chat.png")):
            icon.addFile(str(png))
        svg = resources_dir() / "trellis-chat.svg"
        if icon.isNull() and svg.is_file():
            icon.addFile(str(svg))
    return icon


def static_versions() -> list[tuple[str, str]]:
    """The rows known without importing torch."""
    frozen = getattr(sys, "frozen", False)
    return [
        (APP_TITLE, app_version()),
        ("Installed as", "bundle (PyInstaller)" if frozen else f"Python package ({sys.prefix})"),
        ("Python", platform.python_version()),
        ("Qt / PySide6", f"{qVersion()} / {PySide6.__version__}"),
        ("Operating system", platform.platform()),
    ]


def runtime_versions(report: gpu_check.GpuReport | None) -> list[tuple[str, str]]:
    """torch, CUDA, driver and GPU rows from a GPU report (placeholders while it is running)."""
    if report is None:
        checking = "checking…"
        return [("torch", checking), ("CUDA", checking), ("GPU", checking)]
    f = report.facts
    if f.torch_version is None:
        return [("torch", f"not available ({f.torch_error or 'import failed'})"), ("CUDA", "—"), ("GPU", "—")]
    if f.torch_cuda is None:
        cuda = "none (CPU build of torch)"
    elif f.cuda_available:
        cuda = f"{f.torch_cuda} (available)"
    else:
        cuda = f"{f.torch_cuda} (not available)"
    if f.devices:
        gpus = "; ".join(
            f"{d.name}, {format_bytes(d.memory_bytes, decimals=0)}, "
            f"compute {d.capability[0]}.{d.capability[1]}"
            for d in f.devices
        )
    elif f.nvidia_gpus:
        gpus = f"{', '.join(f.nvidia_gpus)} (not usable by this runtime)"
    else:
        gpus = "none found"
    rows = [("torch", f.torch_version), ("CUDA", cuda), ("GPU", gpus)]
    if f.driver_version:
        supports = f" (CUDA {f.driver_cuda})" if f.driver_cuda else ""
        rows.append(("NVIDIA driver", f.driver_version + supports))
    return rows


def folders() -> list[tuple[str, Path]]:
    from app import paths
    from app.crash import log_dir

    return [
        ("Data folder", paths.data_dir()),
        ("Models folder", paths.models_dir()),
        ("Logs folder", log_dir()),
    ]


class AboutDialog(QDialog):
    """Help › About. ``check`` is injectable for tests; by default the dialog reuses the startup
    GPU report or starts a check of its own."""

    def __init__(self, parent: QWidget | None = None, *, start_check: bool = True) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"About {APP_TITLE}")
        self.setAccessibleName(f"About {APP_TITLE}")
        self.setMinimumWidth(560)
        layout = QVBoxLayout(self)

        title = QLabel(f"<h2>{APP_TITLE} {app_version()}</h2>Chat with language models on your own computer.")
        title.setTextFormat(Qt.TextFormat.RichText)
        icon = app_icon()
        if not icon.isNull():
            self.setWindowIcon(icon)
            picture = QLabel()
            picture.setPixmap(icon.pixmap(64, 64))
            layout.addWidget(picture, alignment=Qt.AlignmentFlag.AlignHCenter)
        layout.addWidget(title)

        self.form = QFormLayout()
        layout.addLayout(self.form)
        self.value_labels: dict[str, QLabel] = {}
        self.gpu_label = QLabel()
        self.gpu_label.setWordWrap(True)
        self.gpu_label.setAccessibleName("GPU report")
        self.gpu_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.gpu_label)

        self.copy_button = QPushButton("Copy details")
        self.copy_button.setToolTip("Copy these versions, for a bug report")
        self.copy_button.clicked.connect(self.copy_details)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.addButton(self.copy_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

        self.report = gpu_check.last_report()
        for label, value in [*static_versions(), *runtime_versions(self.report)]:
            self._row(label, value)
        for label, path in folders():
            self._row(label, str(path))
        self._show_report()
        self.check: gpu_check.GpuCheck | None = None
        if self.report is None and start_check:
            self.check = gpu_check.GpuCheck(self)
            self.check.finished.connect(self.set_report)
            self.check.start()

    def _row(self, label: str, value: str) -> None:
        if label in self.value_labels:
            self.value_labels[label].setText(value)
            return
        widget = QLabel(value)
        widget.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        widget.setAccessibleName(label)
        widget.setWordWrap(True)
        self.value_labels[label] = widget
        self.form.addRow(f"{label}:", widget)

    def set_report(self, report: gpu_check.GpuReport) -> None:
        self.report = report
        for label, value in runtime_versions(report):
            self._row(label, value)
        self._show_report()

    def _show_report(self) -> None:
        if self.report is None:
            self.gpu_label.setText("Checking the GPU and driver…")
        else:
            self.gpu_label.setText(self.report.text())

    def details_text(self) -> str:
        rows = [f"{label}: {widget.text()}" for label, widget in self.value_labels.items()]
        if self.report is not None:
            rows.append(self.report.text())
        return "\n".join(rows)

    def copy_details(self) -> None:
        QGuiApplication.clipboard().setText(self.details_text())


def print_about() -> int:
    """``trellis-chat --about``: the same facts on stdout (checks a bundle without a display)."""
    report = gpu_check.check()
    for label, value in [*static_versions(), *runtime_versions(report)]:
        print(f"{label}: {value}")
    for label, path in folders():
        print(f"{label}: {path}")
    print(report.text())
    return 0
