"""The wheel's tags follow what it carries: pure Python (``py3-none-any``) without the prebuilt
CUDA extension, this Python's ABI and platform with it (setup.py), so that pip never installs a
module of machine code on a machine it was not built for."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "engine/kernels/prebuilt/trellis_ext-2.13.0-cu130.so"


def _wheel(tmp_path: Path, with_module: bool) -> Path:
    """Build the package's wheel from a copy of its sources (no network, no build isolation)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("engine", "app"):
        skip = shutil.ignore_patterns("__pycache__", "trellis_ext-*")
        shutil.copytree(ROOT / package, src / package, ignore=skip)
    if with_module:
        (src / MODULE).write_bytes(b"\x7fELF stand-in")
    out = tmp_path / "out"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*pip, "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def test_without_the_prebuilt_module_the_wheel_is_pure_python(tmp_path) -> None:
    assert _wheel(tmp_path, with_module=False).name.endswith("-py3-none-any.whl")


@pytest.mark.skipif(sys.platform != "linux", reason="the prebuilt module is a Linux shared library")
def test_with_the_prebuilt_module_the_wheel_names_its_python_and_platform(tmp_path) -> None:
    wheel = _wheel(tmp_path, with_module=True)
    abi = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.startswith(f"trellis_chat-0.1.0-{abi}-{abi}-linux_"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        assert MODULE in archive.namelist()
