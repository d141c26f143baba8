"""The GPU-runtime dialog: the offer (what, how big), the download's progress (bytes, speed, time
left), cancel to resume later, errors in words, and a restart into the runtime at the end.

The installer (:class:`app.runtime.install.RuntimeInstaller`) runs on a Python thread; its
progress and its outcome reach this dialog through queued signals, so widgets are only touched
on the GUI thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, Qt, Signal
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QDialog,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.runtime.install import InstallCancelled, InstallProgress, RuntimeInstaller
from app.runtime.lock import RuntimeLock
from engine.units import format_bytes, format_duration

PROGRESS_STEPS = 1000  # QProgressBar holds an int: show per mille, not bytes (GBs overflow it)


def restart_app() -> None:
    """Start a new instance of this app (which picks up the runtime) and quit this one."""
    if getattr(sys, "frozen", False):
        program, args = sys.executable, sys.argv[1:]
    else:
        program, args = sys.executable, ["-m", "app", *sys.argv[1:]]
    QProcess.startDetached(program, args)
    QApplication.quit()


class _InstallRun(QObject):
    """Runs one install on a thread; the signals arrive queued on the GUI thread."""

    progress = Signal(object)  # InstallProgress
    finished = Signal(object)  # the runtime folder, or an Exception (InstallCancelled when cancelled)

    def __init__(self, installer: RuntimeInstaller, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.installer = installer

    def start(self) -> None:
        threading.Thread(target=self._run, name="runtime-install", daemon=True).start()

    def _run(self) -> None:
        try:
            result: object = self.installer.install(self.progress.emit)
        except Exception as exc:  # noqa: BLE001 - every failure is shown in the dialog
            result = exc
        self.finished.emit(result)


class RuntimeDialog(QDialog):
    """Offer, progress, outcome. ``state`` is one of: offer, downloading, cancelling, cancelled,
    failed, installed (the tests read it)."""

    state_changed = Signal(str)

    def __init__(
        self,
        lock: RuntimeLock,
        root: Path,
        *,
        gpu_name: str = "an NVIDIA GPU",
        lead: str | None = None,
        make_installer: Callable[[RuntimeLock, Path], RuntimeInstaller] = RuntimeInstaller,
        restart: Callable[[], None] = restart_app,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Use your GPU")
        self.setMinimumWidth(520)
        self.lock = lock
        self.root = Path(root)
        self.make_installer = make_installer
        self.restart = restart
        self.run: _InstallRun | None = None
        self.state = ""
        self.installer = make_installer(lock, self.root)

        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.bar = QProgressBar()
        self.bar.setRange(0, PROGRESS_STEPS)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.dont_ask = QCheckBox("Don't ask again")
        self.primary = QPushButton()
        self.primary.setDefault(True)
        self.secondary = QPushButton()
        self.primary.clicked.connect(self._primary)
        self.secondary.clicked.connect(self._secondary)
        buttons = QHBoxLayout()
        buttons.addWidget(self.dont_ask)
        buttons.addStretch(1)
        buttons.addWidget(self.secondary)
        buttons.addWidget(self.primary)
        layout = QVBoxLayout(self)
        layout.addWidget(self.message)
        layout.addWidget(self.bar)
        layout.addWidget(self.detail)
        layout.addLayout(buttons)
        self._gpu_name = gpu_name
        self._show_offer(lead)

    # -- states ----------------------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        self.state = state
        self.state_changed.emit(state)

    def _show_offer(self, lead: str | None = None) -> None:
        lock = self.lock
        total = lock.download_size
        have = total - self.installer.remaining_download()
        on_disk = self.installer.unpacked_size()
        text = (
            f"{lead or f'Trellis Chat found {self._gpu_name}, but runs models on the CPU.'} "
            f"To use the GPU, it downloads its GPU runtime once (torch {lock.torch} for CUDA {lock.cuda}): "
            f"<b>{format_bytes(total)}</b> to download, about {format_bytes(on_disk)} on disk in "
            f"{self.root}. You can keep chatting meanwhile; Trellis Chat restarts to use it."
        )
        if have > 0:
            text += f"<br><br>{format_bytes(have)} of it were downloaded before; the download resumes."
        self.message.setText(text)
        self.bar.setVisible(have > 0)
        self.bar.setValue(round(PROGRESS_STEPS * have / total) if total else 0)
        self.detail.setText("")
        self.primary.setText(
            f"Resume download ({format_bytes(total - have)})" if have else f"Download {format_bytes(total)}"
        )
        self.primary.setEnabled(True)
        self.secondary.setText("Not now")
        self.secondary.setEnabled(True)
        self.dont_ask.setVisible(True)
        self._set_state("offer")

    def _start(self) -> None:
        self.installer = self.make_installer(self.lock, self.root)
        self.run = _InstallRun(self.installer, self)
        self.run.progress.connect(self._on_progress)
        self.run.finished.connect(self._on_finished)
        self.message.setText(
            f"Downloading the GPU runtime (torch {self.lock.torch} for CUDA {self.lock.cuda})…"
        )
        self.bar.setVisible(True)
        self.detail.setText("Checking free disk space…")
        self.primary.setText("Cancel")
        self.secondary.setText("Hide")
        self.dont_ask.setVisible(False)
        self._set_state("downloading")
        self.run.start()

    def _on_progress(self, p: InstallProgress) -> None:
        if self.state != "downloading":
            return
        self.bar.setValue(round(PROGRESS_STEPS * p.done / p.total) if p.total else 0)
        if p.stage == "download":
            parts = [f"{format_bytes(p.done)} of {format_bytes(p.total)}"]
            if p.speed > 0:
                parts.append(f"{format_bytes(p.speed)}/s")
            if p.eta is not None:
                parts.append(f"{format_duration(p.eta)} left")
            text = " · ".join(parts)
            self.detail.setText(text + (f"\n{p.note}" if p.note else ""))
        elif p.stage == "unpack":
            self.detail.setText(f"Unpacking {p.current or ''}…")
        elif p.stage == "check":
            self.detail.setText("Checking that the GPU runtime works on this computer…")

    def _on_finished(self, result: object) -> None:
        self.run = None
        if not self.isVisible():
            self.show()  # hidden while downloading: the outcome needs the user
        if isinstance(result, InstallCancelled):
            self.message.setText("Download paused. It resumes where it stopped, now or at the next start.")
            total = self.lock.download_size
            have = total - self.installer.remaining_download()
            self.detail.setText(f"{format_bytes(have)} of {format_bytes(total)} downloaded.")
            self.primary.setText("Resume")
            self.primary.setEnabled(True)
            self.secondary.setText("Close")
            self.secondary.setEnabled(True)
            self._set_state("cancelled")
        elif isinstance(result, Exception):
            self.message.setText("The GPU runtime could not be installed. Trellis Chat keeps using the CPU.")
            self.detail.setText(str(result))
            self.primary.setText("Try again")
            self.primary.setEnabled(True)
            self.secondary.setText("Close")
            self.secondary.setEnabled(True)
            self._set_state("failed")
        else:
            self.bar.setValue(PROGRESS_STEPS)
            self.message.setText(
                "The GPU runtime is installed. Restart Trellis Chat to run models on the GPU."
            )
            self.detail.setText(f"Installed in {result}.")
            self.primary.setText("Restart now")
            self.primary.setEnabled(True)
            self.secondary.setText("Later")
            self.secondary.setEnabled(True)
            self._set_state("installed")

    # -- buttons ---------------------------------------------------------------------------------

    def _primary(self) -> None:
        if self.state in ("offer", "cancelled", "failed"):
            self._start()
        elif self.state == "downloading":
            self.cancel()
        elif self.state == "installed":
            self.accept()
            self.restart()

    def _secondary(self) -> None:
        if self.state == "downloading":
            self.hide()  # the download goes on; closing the app pauses it
        else:
            self.reject()

    def cancel(self) -> None:
        """Stop the download at the next chunk (or retry wait); it resumes later."""
        if self.run is not None:
            self.installer.cancel()
            self.primary.setEnabled(False)
            self.detail.setText("Pausing…")
            self._set_state("cancelling")

    def reject(self) -> None:
        if self.run is not None:  # Escape or the close box while downloading: pause, don't abandon
            self.cancel()
            return
        super().reject()
