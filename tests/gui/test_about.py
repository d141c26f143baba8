"""Help › About lists the versions a bug report needs (app, Python, Qt, torch, CUDA, GPU), fills
in the torch rows from a background check, and copies everything as text; the startup GPU
report appears in the main window's status bar."""

from __future__ import annotations

import platform
from importlib import metadata

import pytest
from PySide6.QtGui import QGuiApplication

from app import gpu_check
from app.about import AboutDialog, app_version, runtime_versions
from app.gpu_check import GpuDevice, GpuFacts, GpuReport, diagnose


@pytest.fixture(autouse=True)
def _fresh_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "_last", None)  # each test decides whether a report exists


def test_about_lists_real_versions_and_fills_in_torch_in_the_background(qtbot, data_dir) -> None:
    torch = pytest.importorskip("torch")
    dialog = AboutDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    rows = {label: widget.text() for label, widget in dialog.value_labels.items()}
    assert rows["Trellis Chat"] == app_version()
    try:
        assert rows["Trellis Chat"] == metadata.version("trellis-chat")
    except metadata.PackageNotFoundError:
        pass  # a source tree run without pip install reads pyproject instead
    assert rows["Python"] == platform.python_version()
    assert rows["Data folder"] == str(data_dir)
    assert rows["Logs folder"] == str(data_dir / "logs")

    qtbot.waitUntil(lambda: dialog.report is not None, timeout=120_000)
    rows = {label: widget.text() for label, widget in dialog.value_labels.items()}
    assert rows["torch"] == torch.__version__
    if torch.version.cuda is None:
        assert rows["CUDA"] == "none (CPU build of torch)"
    else:
        assert rows["CUDA"].startswith(torch.version.cuda)
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in rows["GPU"]
    assert dialog.gpu_label.text().startswith(dialog.report.headline)

    dialog.copy_details()
    copied = QGuiApplication.clipboard().text()
    assert f"torch: {torch.__version__}" in copied and f"Trellis Chat: {app_version()}" in copied
    assert dialog.report.headline in copied


def test_about_shows_a_gpu_machine(qtbot, data_dir) -> None:
    facts = GpuFacts(
        torch_version="2.11.0+cu128",
        torch_cuda="12.8",
        cuda_available=True,
        devices=(GpuDevice("NVIDIA H200", 141 * 2**30, (9, 0)),),
        arch_list=("sm_90",),
        driver_version="570.124.06",
        driver_cuda="12.8",
    )
    dialog = AboutDialog(start_check=False)
    qtbot.addWidget(dialog)
    assert dialog.value_labels["torch"].text() == "checking…"
    dialog.set_report(diagnose(facts))
    rows = {label: widget.text() for label, widget in dialog.value_labels.items()}
    assert rows["torch"] == "2.11.0+cu128"
    assert rows["CUDA"] == "12.8 (available)"
    assert rows["GPU"] == "NVIDIA H200, 141 GiB, compute 9.0"
    assert rows["NVIDIA driver"] == "570.124.06 (CUDA 12.8)"
    assert dialog.gpu_label.text().startswith("GPU found: NVIDIA H200")


def test_runtime_rows_when_torch_is_broken() -> None:
    rows = dict(runtime_versions(diagnose(GpuFacts(torch_error="ImportError: no libtorch"))))
    assert rows["torch"] == "not available (ImportError: no libtorch)"


def test_help_menu_opens_about_reusing_the_startup_report(qtbot, window) -> None:
    report = diagnose(GpuFacts(torch_version="2.13.0+cpu", platform="linux"))
    gpu_check._last = report
    help_menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Help")
    about = next(a for a in help_menu.actions() if a.text() == "&About Trellis Chat")
    about.trigger()
    dialog = window.about_dialog
    qtbot.waitUntil(dialog.isVisible)
    assert dialog.check is None  # no second check: the startup one already answered
    assert dialog.value_labels["torch"].text() == "2.13.0+cpu"
    dialog.close()


def test_status_bar_shows_where_models_run(window) -> None:
    report = GpuReport(
        True,
        "GPU found: NVIDIA H200, 141 GiB. Models run on the GPU.",
        facts=GpuFacts(
            torch_version="2.11",
            cuda_available=True,
            devices=(GpuDevice("NVIDIA H200", 141 * 2**30, (9, 0)),),
        ),
    )
    window.show_gpu_report(report)
    assert window.gpu_label.text() == "GPU: NVIDIA H200"
    assert window.gpu_label.toolTip() == report.text()
    assert window.statusBar().currentMessage() == report.headline
    cpu = diagnose(GpuFacts(torch_version="2.13.0+cpu", platform="linux"))
    window.show_gpu_report(cpu)  # a later report replaces the label, it does not add a second
    assert window.gpu_label.text() == "CPU"
    assert window.statusBar().currentMessage().startswith("Using the CPU because")
