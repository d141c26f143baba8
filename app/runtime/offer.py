"""When to offer the GPU runtime, and opening the dialog that does.

Offered once the startup GPU check (``app.gpu_check``) has run, when all hold: this is the bundle
(source installs manage their own torch), the loaded torch has no CUDA although the NVIDIA driver
shows a GPU, Settings › Device is not "CPU", the user did not tick "Don't ask again", and a
runtime of this release fits the driver. An old driver gets no dialog: the GPU check's advice
already says to update it.

Settings › GPU runtime offers the same dialog again after the user removed the runtime
(:func:`offer_after_removal`): by the same rules, as they will stand once the app restarts on the
CPU build, and whatever "Don't ask again" said (the user is asking).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QWidget

from app.gpu_check import GpuReport
from app.runtime.activate import last_activation, managed_runtime_enabled, runtime_root
from app.runtime.lock import LockError, RuntimeLock, shipped_locks
from app.runtime.variant import choose

DISMISSED = "runtime.offer_dismissed"


def runtime_to_offer(
    report: GpuReport,
    *,
    enabled: bool,
    dismissed: bool,
    locks: list[RuntimeLock],
) -> RuntimeLock | None:
    """The runtime to offer for ``report``'s machine, or None when there is nothing to offer."""
    f = report.facts
    if not enabled or dismissed or f.preference == "cpu":
        return None
    if f.torch_version is None or f.torch_cuda is not None:
        return None  # no torch at all (another problem), or the CUDA build already
    if not (f.driver_version or f.nvidia_gpus):
        return None
    return choose(locks, f.driver_cuda).lock


def maybe_offer(window: QWidget, report: GpuReport, settings: Any, data_dir: Path) -> QWidget | None:
    """Open the offer over ``window`` when :func:`runtime_to_offer` finds one; the dialog (or None)."""
    try:
        locks = shipped_locks()
    except LockError:
        return None  # a damaged lock file in the install: no offer rather than a crash
    lock = runtime_to_offer(
        report, enabled=managed_runtime_enabled(), dismissed=bool(settings.get(DISMISSED)), locks=locks
    )
    if lock is None:
        return None
    activation = last_activation()
    said = activation.message if activation is not None else None
    lead = f"{said[0].upper()}{said[1:]}." if said else None  # the installed one failed: say why
    dialog = open_runtime_dialog(window, lock, report, data_dir, lead=lead)
    dialog.finished.connect(lambda _result: settings.set(DISMISSED, dialog.dont_ask.isChecked()))
    return dialog


def offer_after_removal(report: GpuReport | None) -> RuntimeLock | None:
    """The runtime to offer once the installed one is removed: what the first-run offer would
    find after the restart onto the CPU build (None without a GPU report, or nothing to offer)."""
    if report is None:
        return None
    try:
        locks = shipped_locks()
    except LockError:
        return None
    on_cpu = dataclasses.replace(report, facts=dataclasses.replace(report.facts, torch_cuda=None))
    return runtime_to_offer(on_cpu, enabled=managed_runtime_enabled(), dismissed=False, locks=locks)


def open_runtime_dialog(
    window: QWidget, lock: RuntimeLock, report: GpuReport, data_dir: Path, lead: str | None = None
) -> QWidget:
    """Open the download dialog for ``lock`` over ``window`` (window-modal); returns it."""
    from app.runtime.dialog import RuntimeDialog

    names = report.facts.nvidia_gpus
    dialog = RuntimeDialog(
        lock,
        runtime_root(data_dir),
        gpu_name=names[0] if names else "an NVIDIA GPU",
        lead=lead,
        parent=window,
    )
    dialog.open()
    return dialog
