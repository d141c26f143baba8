"""The GPU-runtime offer and its dialog, offscreen, against a local file server: the size up
front, progress with bytes, speed and time left, cancel and resume, a corrupt download, a full
disk, "don't ask again", and the restart at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from wheel_server import BIG_WHEEL, WheelServer, fake_runtime_wheels, lock_for

from app.gpu_check import GpuFacts, diagnose
from app.runtime import activate as act
from app.runtime.dialog import PROGRESS_STEPS, RuntimeDialog
from app.runtime.install import RuntimeInstaller
from app.runtime.lock import LOCKS_DIR, read_lock
from app.runtime.offer import DISMISSED, maybe_offer, runtime_to_offer
from engine.hub.retry import RetryPolicy

CPU_TORCH_WITH_GPU = GpuFacts(
    torch_version="2.13.0+cpu",
    driver_version="580.65",
    driver_cuda="13.0",
    nvidia_gpus=("NVIDIA GeForce RTX 4090",),
)


def factory(**kw):
    kw.setdefault("check", lambda folder: None)
    kw.setdefault("retry", RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05))
    return lambda lock, root: RuntimeInstaller(lock, root, progress_interval=0.0, **kw)


@pytest.fixture
def server():
    with WheelServer(fake_runtime_wheels()) as s:
        yield s


def make_dialog(qtbot, server, tmp_path: Path, **kw) -> tuple[RuntimeDialog, list]:
    restarts: list[bool] = []
    dialog = RuntimeDialog(
        lock_for(server.files, server.url),
        tmp_path / "runtime",
        gpu_name="NVIDIA GeForce RTX 4090",
        make_installer=kw.pop("make_installer", factory()),
        restart=lambda: restarts.append(True),
        **kw,
    )
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog, restarts


def test_the_offer_says_the_size_of_the_shipped_runtime_up_front(qtbot, tmp_path: Path) -> None:
    lock = read_lock(LOCKS_DIR / "runtime-cu130.lock.json")
    dialog = RuntimeDialog(lock, tmp_path / "runtime", gpu_name="NVIDIA RTX A6000", restart=lambda: None)
    qtbot.addWidget(dialog)
    assert dialog.state == "offer"
    assert "NVIDIA RTX A6000" in dialog.message.text()
    assert "<b>2.6 GiB</b> to download" in dialog.message.text() and "on disk" in dialog.message.text()
    assert dialog.primary.text() == "Download 2.6 GiB"


def test_download_shows_progress_then_restarts_into_the_runtime(qtbot, server, tmp_path: Path) -> None:
    dialog, restarts = make_dialog(qtbot, server, tmp_path)
    with qtbot.waitSignal(dialog.state_changed, timeout=5000, check_params_cb=lambda s: s == "installed"):
        dialog.primary.click()
        assert dialog.state == "downloading" and dialog.primary.text() == "Cancel"
    assert dialog.bar.value() == PROGRESS_STEPS
    assert dialog.primary.text() == "Restart now"
    root = tmp_path / "runtime"
    assert act.read_current(root) == "torch-2.13.0-cu130"
    dialog.primary.click()
    assert restarts == [True]


def test_progress_text_has_bytes_speed_and_time_left(qtbot, server, tmp_path: Path) -> None:
    from app.runtime.install import InstallProgress

    dialog, _ = make_dialog(qtbot, server, tmp_path)
    dialog.state = "downloading"
    dialog._on_progress(
        InstallProgress("download", 1 << 30, 3 << 30, speed=20 << 20, eta=102.4, current="x.whl")
    )
    assert dialog.detail.text() == "1.0 GiB of 3.0 GiB · 20.0 MiB/s · 1 min 42 s left"
    assert dialog.bar.value() == PROGRESS_STEPS // 3


def test_cancel_then_resume_continues_where_it_stopped(qtbot, server, tmp_path: Path) -> None:
    # The connection drops after 100 kB and the retry waits long: the user cancels during the wait.
    server.drop_after[BIG_WHEEL] = 100_000
    slow_retry = factory(retry=RetryPolicy(max_attempts=3, base_delay=30, jitter=0))
    dialog, _ = make_dialog(qtbot, server, tmp_path, make_installer=slow_retry)
    dialog.primary.click()
    part = tmp_path / "runtime" / "downloads" / "torch-2.13.0-cu130" / f"{BIG_WHEEL}.part"
    qtbot.waitUntil(lambda: "trying again" in dialog.detail.text(), timeout=5000)
    with qtbot.waitSignal(dialog.state_changed, timeout=5000, check_params_cb=lambda s: s == "cancelled"):
        dialog.primary.click()  # Cancel
    assert part.stat().st_size == 100_000
    assert "downloaded" in dialog.detail.text() and dialog.primary.text() == "Resume"
    assert act.read_current(tmp_path / "runtime") is None
    # A new dialog (the next start) offers to resume, with the amount left.
    again, restarts = make_dialog(qtbot, server, tmp_path)
    assert "were downloaded before" in again.message.text() and again.primary.text().startswith(
        "Resume download"
    )
    assert again.bar.isVisible() and 0 < again.bar.value() < PROGRESS_STEPS
    server.requests.clear()
    with qtbot.waitSignal(again.state_changed, timeout=5000, check_params_cb=lambda s: s == "installed"):
        again.primary.click()
    assert (BIG_WHEEL, "bytes=100000-") in server.requests


def test_a_corrupt_download_ends_in_a_clear_error_and_the_cpu(qtbot, server, tmp_path: Path) -> None:
    server.corrupt.add(BIG_WHEEL)
    dialog, _ = make_dialog(qtbot, server, tmp_path)
    with qtbot.waitSignal(dialog.state_changed, timeout=5000, check_params_cb=lambda s: s == "failed"):
        dialog.primary.click()
    assert "keeps using the CPU" in dialog.message.text()
    assert "SHA-256" in dialog.detail.text() and dialog.primary.text() == "Try again"
    assert act.read_current(tmp_path / "runtime") is None


def test_a_full_disk_is_said_before_downloading(qtbot, server, tmp_path: Path) -> None:
    dialog, _ = make_dialog(qtbot, server, tmp_path, make_installer=factory(free_bytes=lambda path: 10 << 20))
    with qtbot.waitSignal(dialog.state_changed, timeout=5000, check_params_cb=lambda s: s == "failed"):
        dialog.primary.click()
    assert "10.0 MiB free" in dialog.detail.text() and "needed" in dialog.detail.text()
    assert server.requests == []


# -- when the offer appears -------------------------------------------------------------------------


def test_offered_only_for_an_unused_nvidia_gpu_in_the_bundle() -> None:
    locks = [read_lock(LOCKS_DIR / "runtime-cu130.lock.json")]
    report = diagnose(CPU_TORCH_WITH_GPU)
    assert runtime_to_offer(report, enabled=True, dismissed=False, locks=locks) is locks[0]
    assert runtime_to_offer(report, enabled=False, dismissed=False, locks=locks) is None  # source install
    assert runtime_to_offer(report, enabled=True, dismissed=True, locks=locks) is None  # don't ask again
    driver = {"driver_version": "580.65", "driver_cuda": "13.0"}
    cases = {
        "CUDA torch already": GpuFacts(torch_version="2.13.0", torch_cuda="13.0", **driver),
        "no NVIDIA GPU": GpuFacts(torch_version="2.13.0+cpu"),
        "device set to CPU": GpuFacts(torch_version="2.13.0+cpu", preference="cpu", **driver),
        "driver too old": GpuFacts(torch_version="2.13.0+cpu", driver_version="550.54", driver_cuda="12.4"),
    }
    for why, facts in cases.items():
        assert runtime_to_offer(diagnose(facts), enabled=True, dismissed=False, locks=locks) is None, why


def test_dont_ask_again_is_remembered(qtbot, monkeypatch, tmp_path: Path) -> None:
    from PySide6.QtWidgets import QWidget

    monkeypatch.setenv("TRELLIS_MANAGED_RUNTIME", "1")
    settings = {DISMISSED: False}

    class FakeSettings:
        def get(self, key):
            return settings[key]

        def set(self, key, value):
            settings[key] = value

    window = QWidget()
    qtbot.addWidget(window)
    dialog = maybe_offer(window, diagnose(CPU_TORCH_WITH_GPU), FakeSettings(), tmp_path / "data")
    assert isinstance(dialog, RuntimeDialog) and dialog.root == tmp_path / "data" / "runtime"
    dialog.dont_ask.setChecked(True)
    dialog.secondary.click()  # Not now
    assert settings[DISMISSED] is True
    assert maybe_offer(window, diagnose(CPU_TORCH_WITH_GPU), FakeSettings(), tmp_path / "data") is None
