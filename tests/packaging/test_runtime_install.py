"""The GPU runtime's installer against a local file server: a whole install, resume after a
dropped connection and after a cancel, a corrupt download, a full disk, a runtime that fails its
check; and the startup hook that puts an installed runtime on ``sys.path``."""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
from wheel_server import BIG_WHEEL, WheelServer, fake_runtime_wheels, fake_wheel, lock_for

from app.runtime import activate as act
from app.runtime.install import InstallCancelled, RuntimeInstaller, RuntimeInstallError, unpack_wheel
from engine.hub.errors import InsufficientSpaceError
from engine.hub.retry import RetryPolicy

FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)


def ok_check(folder: Path) -> None:
    assert (folder / "site-packages" / "torch" / "__init__.py").is_file()  # checked before the switch
    return None


def installer(lock, root: Path, **kw) -> RuntimeInstaller:
    kw.setdefault("check", ok_check)
    kw.setdefault("progress_interval", 0.0)
    return RuntimeInstaller(lock, root, retry=FAST_RETRY, **kw)


@pytest.fixture
def server():
    with WheelServer(fake_runtime_wheels()) as s:
        yield s


def test_install_unpacks_every_wheel_and_writes_current_last(server, tmp_path: Path) -> None:
    lock = lock_for(server.files, server.url)
    stages = []
    folder = installer(lock, tmp_path / "runtime").install(lambda p: stages.append(p.stage))
    site = folder / "site-packages"
    assert folder == tmp_path / "runtime" / "torch-2.13.0-cu130"
    assert (site / "torch" / "__init__.py").read_bytes() == b"__version__ = '2.13.0+fake'\n"
    assert (site / "torch" / "extra.py").is_file()  # *.data/purelib lands in site-packages
    assert not (site / "torch-2.13.0.data").exists()  # scripts are not needed
    assert os.stat(site / "nvidia/fake/bin/tool").st_mode & stat.S_IXUSR
    assert (site / "nvidia/fake/lib/libfake.so").stat().st_size == 256 * 2048
    assert (tmp_path / "runtime" / "current").read_text().strip() == lock.name
    record = json.loads((folder / "runtime.json").read_text())
    assert record["complete"] is True and record["python"] == "cp311"
    assert not (tmp_path / "runtime" / "downloads" / lock.name).exists()
    assert not (tmp_path / "runtime" / f".staging-{lock.name}").exists()
    assert stages[0] == "download" and "unpack" in stages and stages[-1] == "done"


def test_a_dropped_connection_resumes_with_a_range_request(server, tmp_path: Path) -> None:
    server.drop_after[BIG_WHEEL] = 100_000
    lock = lock_for(server.files, server.url)
    notes = []
    installer(lock, tmp_path / "runtime").install(lambda p: notes.append(p.note))
    ranges = [r for name, r in server.requests if name == BIG_WHEEL]
    assert ranges == [None, "bytes=100000-"]
    assert (
        tmp_path / "runtime" / lock.name / "site-packages/nvidia/fake/lib/libfake.so"
    ).stat().st_size == 256 * 2048


def test_cancel_keeps_the_partial_download_and_the_next_attempt_resumes(server, tmp_path: Path) -> None:
    lock = lock_for(server.files, server.url)
    root = tmp_path / "runtime"
    first = installer(lock, root)
    server.drop_after[BIG_WHEEL] = 200_000  # the connection drops; the user cancels during the wait

    def cancel_when_partial(progress) -> None:
        if progress.current == BIG_WHEEL and progress.done > lock.wheels[0].size:  # some of BIG_WHEEL arrived
            first.cancel()

    with pytest.raises(InstallCancelled):
        first.install(cancel_when_partial)
    part = root / "downloads" / lock.name / f"{BIG_WHEEL}.part"
    assert part.is_file() and 0 < part.stat().st_size < len(server.files[BIG_WHEEL])
    assert not (root / "current").exists()
    assert act.read_current(root) is None
    have = part.stat().st_size
    second = installer(lock, root)
    assert second.remaining_download() == len(server.files[BIG_WHEEL]) - have
    server.requests.clear()
    second.install()
    assert (BIG_WHEEL, f"bytes={have}-") in server.requests
    assert act.read_current(root) == lock.name


def test_a_corrupt_download_is_refused_and_nothing_is_installed(server, tmp_path: Path) -> None:
    server.corrupt.add(BIG_WHEEL)
    lock = lock_for(server.files, server.url)
    root = tmp_path / "runtime"
    with pytest.raises(RuntimeInstallError, match="SHA-256"):
        installer(lock, root).install()
    assert [name for name, _ in server.requests].count(BIG_WHEEL) == 2  # started over once
    assert not (root / "current").exists() and not (root / lock.name).exists()
    assert not (root / "downloads" / lock.name / f"{BIG_WHEEL}.part").exists()


def test_not_enough_disk_space_is_said_before_anything_is_downloaded(server, tmp_path: Path) -> None:
    lock = lock_for(server.files, server.url)
    inst = installer(lock, tmp_path / "runtime", free_bytes=lambda path: 50 << 20)
    with pytest.raises(InsufficientSpaceError) as caught:
        inst.install()
    message = str(caught.value)
    assert "50.0 MiB free" in message and "needed" in message and str(tmp_path / "runtime") in message
    assert caught.value.free == 50 << 20 and caught.value.required == inst.space_needed()
    assert server.requests == []


def test_a_runtime_that_fails_its_check_is_not_switched_to(server, tmp_path: Path) -> None:
    lock = lock_for(server.files, server.url)
    root = tmp_path / "runtime"
    with pytest.raises(RuntimeInstallError, match="no GPU seen"):
        installer(lock, root, check=lambda folder: "no GPU seen").install()
    assert not (root / "current").exists()
    assert not (root / lock.name).exists() and not (root / f".staging-{lock.name}").exists()
    # The verified downloads stay: trying again (e.g. after a driver update) downloads nothing.
    server.requests.clear()
    installer(lock, root).install()
    assert server.requests == [] and act.read_current(root) == lock.name


def test_unpack_refuses_paths_that_leave_the_folder(tmp_path: Path) -> None:
    bad = tmp_path / "bad.whl"
    bad.write_bytes(fake_wheel("bad", {"../escape.py": b"x"}))
    with pytest.raises(ValueError, match="unsafe path"):
        unpack_wheel(bad, tmp_path / "site")
    assert not (tmp_path / "escape.py").exists()
    assert zipfile.is_zipfile(bad)


# -- the startup hook ------------------------------------------------------------------------------


def test_activation_puts_an_installed_runtime_first_on_sys_path(server, tmp_path, monkeypatch) -> None:
    lock = lock_for(server.files, server.url)
    data = tmp_path / "data"
    installer(lock, data / "runtime").install()
    monkeypatch.setattr("sys.path", ["/bundle"])
    result = act.activate(["--data-dir", str(data)], environ={}, modules={})
    assert result == act.Activation(data / "runtime" / lock.name, None)
    import sys

    assert sys.path == [str(data / "runtime" / lock.name / "site-packages"), "/bundle"]
    assert act.last_activation() is result


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: (f / "runtime.json").unlink(), "no readable runtime.json"),
        (lambda f: (f / "site-packages/torch/__init__.py").unlink(), "torch is missing"),
        (
            lambda f: (f / "runtime.json").write_text(json.dumps({"complete": True, "python": "cp39"})),
            "made for Python cp39",
        ),
    ],
)
def test_a_damaged_runtime_falls_back_to_the_cpu_build_and_says_why(
    server, tmp_path, monkeypatch, capsys, damage, says
) -> None:
    lock = lock_for(server.files, server.url)
    data = tmp_path / "data"
    folder = installer(lock, data / "runtime").install()
    damage(folder)
    monkeypatch.setattr("sys.path", ["/bundle"])
    result = act.activate([], environ={"TRELLIS_DATA_DIR": str(data)}, modules={})
    assert result.runtime is None and says in result.message and "CPU build of torch" in result.message
    import sys

    assert sys.path == ["/bundle"]
    assert says in capsys.readouterr().err


def test_activation_without_a_runtime_or_when_turned_off_changes_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("sys.path", ["/bundle"])
    assert act.activate([f"--data-dir={tmp_path}"], environ={}, modules={}) == act.Activation(None, None)
    assert act.activate([], environ={"TRELLIS_RUNTIME": "cpu"}, modules={}) == act.Activation(None, None)
    late = act.activate([], environ={"TRELLIS_RUNTIME_CANDIDATE": str(tmp_path)}, modules={"torch": object()})
    assert late.runtime is None and "imported before" in late.message
    import sys

    assert sys.path == ["/bundle"]


def test_managed_runtime_is_for_the_bundle_only(monkeypatch) -> None:
    monkeypatch.delattr("sys.frozen", raising=False)
    assert not act.managed_runtime_enabled({})
    assert act.managed_runtime_enabled({"TRELLIS_MANAGED_RUNTIME": "1"})
    monkeypatch.setattr("sys.frozen", True, raising=False)
    assert act.managed_runtime_enabled({})


FAKE_CUDA_TORCH = """\
import types
__version__ = "2.13.0+runtime"
version = types.SimpleNamespace(cuda="13.0")
class cuda:
    @staticmethod
    def is_available():
        return False
"""


def run_launcher(data: Path, **env: str):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, str(root / "packaging" / "launcher.py"), "--data-dir", str(data), "--about"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "TRELLIS_MANAGED_RUNTIME": "1", **env},
    )


def test_the_launcher_imports_torch_from_the_installed_runtime(tmp_path: Path) -> None:
    folder = tmp_path / "data" / "runtime" / "torch-2.13.0-cu130"
    (folder / "site-packages" / "torch").mkdir(parents=True)
    (folder / "site-packages" / "torch" / "__init__.py").write_text(FAKE_CUDA_TORCH)
    (folder / "runtime.json").write_text(json.dumps({"complete": True, "python": act.python_tag()}))
    (tmp_path / "data" / "runtime" / "current").write_text("torch-2.13.0-cu130\n")
    result = run_launcher(tmp_path / "data")
    assert result.returncode == 0, result.stderr
    assert "torch: 2.13.0+runtime" in result.stdout.splitlines()
    # Damaged (the record is gone): the bundled torch, and the reason on stderr.
    (folder / "runtime.json").unlink()
    result = run_launcher(tmp_path / "data")
    assert result.returncode == 0, result.stderr
    import torch

    assert f"torch: {torch.__version__}" in result.stdout.splitlines()
    assert "the GPU runtime cannot be used" in result.stderr and "CPU build of torch" in result.stderr


# -- without a window: trellis-chat --install-gpu-runtime ---------------------------------------------


def test_command_line_install_takes_local_wheels_and_downloads_the_rest(
    server, tmp_path, monkeypatch, capsys
):
    from app.runtime import cli

    lock = lock_for(server.files, server.url)
    monkeypatch.setattr(cli, "shipped_locks", lambda: [lock])
    monkeypatch.setattr(cli, "RuntimeInstaller", lambda lk, root: installer(lk, root))
    local = tmp_path / "wheels"
    local.mkdir()
    torch_wheel = lock.wheels[0].filename
    (local / torch_wheel).write_bytes(server.files[torch_wheel])  # matches the lock: used
    (local / BIG_WHEEL).write_bytes(b"not the wheel")  # does not match: downloaded instead
    assert cli.install_gpu_runtime(tmp_path / "data", local, driver_cuda="13.0") == 0
    out = capsys.readouterr().out
    assert "to download" in out and f"Taken from {local}: " in out and "Installed in" in out
    assert [name for name, _ in server.requests] == [BIG_WHEEL]
    assert act.read_current(tmp_path / "data" / "runtime") == lock.name


def test_command_line_install_says_why_nothing_fits(server, tmp_path, monkeypatch, capsys):
    from app.runtime import cli

    monkeypatch.setattr(cli, "shipped_locks", lambda: [lock_for(server.files, server.url)])
    assert cli.install_gpu_runtime(tmp_path / "data", driver_cuda="12.4") == 1
    assert "Update the NVIDIA driver" in capsys.readouterr().err
    assert server.requests == []
