"""Settings › GPU runtime: an installed runtime (a fake folder under the test's data dir) is shown
with its size; "Remove GPU runtime…" asks, saying what it frees and that the CPU is used after a
restart; the folder goes, the box says so, and offers the download again where the first-run
offer applies."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtWidgets import QMessageBox

from app.gpu_check import GpuFacts, diagnose
from app.runtime import activate as act
from app.settings.gpu_runtime import GpuRuntimeBox, folder_size

# The app runs on the runtime's CUDA torch now; after removal it would be the CPU build.
ON_THE_RUNTIME = GpuFacts(
    torch_version="2.13.0+cu130",
    torch_cuda="13.0",
    driver_version="580.65",
    driver_cuda="13.0",
    nvidia_gpus=("NVIDIA GeForce RTX 4090",),
)


def fake_runtime(data_dir: Path) -> Path:
    """An installed runtime as the installer leaves it: the folder, its record, ``current``."""
    root = act.runtime_root(data_dir)
    folder = root / "torch-2.13.0-cu130"
    (folder / "site-packages" / "torch").mkdir(parents=True)
    (folder / "site-packages" / "torch" / "__init__.py").write_bytes(b"x" * 3_000_000)
    (folder / "site-packages" / "torch" / "lib.so").write_bytes(b"y" * 1_500_000)
    (folder / act.RECORD).write_text(json.dumps({"complete": True, "torch": "2.13.0", "cuda": "13.0"}))
    (root / "downloads").mkdir()
    (root / act.CURRENT).write_text(folder.name)
    return folder


def test_the_settings_pane_removes_the_installed_runtime_and_offers_it_again(
    qtbot, make_window, data_dir, asked, monkeypatch
) -> None:
    monkeypatch.setenv(act.ENABLE_ENV, "1")  # as in the bundle
    folder = fake_runtime(data_dir)
    size = folder_size(folder)
    assert size > 4_500_000
    window = make_window()
    box = window.settings_page.gpu_runtime
    window.show_gpu_report(diagnose(ON_THE_RUNTIME))
    assert box.isVisibleTo(window.settings_page)
    assert "torch 2.13.0 for CUDA 13.0" in box.status.text() and "4.3 MiB" in box.status.text()
    assert box.remove_button.isVisibleTo(box) and not box.install_button.isVisibleTo(box)

    box.remove_button.click()
    assert len(asked) == 1
    assert "frees 4.3 MiB" in asked[0] and "use the CPU after a restart" in asked[0]
    # Deleted on a thread of its own: the box says so meanwhile, and the window stays responsive.
    assert box.removal is not None and box.removal.name == "remove-gpu-runtime"
    qtbot.waitUntil(lambda: "removed (" in box.status.text(), timeout=10_000)
    assert box.removal is not None and not box.removal.is_alive() and box.remove_button.isEnabled()
    assert not folder.exists() and act.read_current(act.runtime_root(data_dir)) is None
    assert "removed (4.3 MiB freed)" in box.status.text() and "CPU after a restart" in box.status.text()
    assert not box.remove_button.isVisibleTo(box)
    assert box.install_button.isVisibleTo(box)  # a GPU the CPU build cannot use: the offer applies

    box.install_button.click()
    dialog = box.dialog
    qtbot.addWidget(dialog)
    assert dialog.state == "offer" and "NVIDIA GeForce RTX 4090" in dialog.message.text()
    dialog.reject()


def test_a_no_keeps_the_runtime(qtbot, data_dir, monkeypatch) -> None:
    folder = fake_runtime(data_dir)
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *a, **k: QMessageBox.StandardButton.No))
    box = GpuRuntimeBox(act.runtime_root(data_dir))
    qtbot.addWidget(box)
    box.remove_button.click()
    assert folder.is_dir() and box.remove_button.isVisibleTo(box)


def test_no_install_offer_without_a_gpu_it_would_fit(qtbot, data_dir, asked, monkeypatch) -> None:
    monkeypatch.setenv(act.ENABLE_ENV, "1")
    fake_runtime(data_dir)
    offered = []
    box = GpuRuntimeBox(act.runtime_root(data_dir), open_offer=lambda lock, report: offered.append(lock))
    qtbot.addWidget(box)
    box.set_report(diagnose(GpuFacts(torch_version="2.13.0+cpu")))  # no NVIDIA GPU at all
    box.remove_button.click()
    qtbot.waitUntil(lambda: "removed (" in box.status.text(), timeout=10_000)
    assert not box.install_button.isVisibleTo(box)
    box.offer_install()
    assert offered == []


def test_a_source_install_without_a_runtime_has_no_box(qtbot, data_dir, monkeypatch) -> None:
    monkeypatch.delenv(act.ENABLE_ENV, raising=False)
    box = GpuRuntimeBox(act.runtime_root(data_dir))
    qtbot.addWidget(box)
    assert box.isHidden()
