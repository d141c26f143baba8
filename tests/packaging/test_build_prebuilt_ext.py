"""packaging/build_prebuilt_ext.py without compiling: it refuses a CPU torch with a clear message,
picks the architectures the CUDA version can compile, and its runtime zip unpacks to where the
loader looks (beside torch)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from app.runtime.install import unpack_wheel
from engine.kernels import loader, prebuilt

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "packaging" / "build_prebuilt_ext.py"


def load_script():
    spec = importlib.util.spec_from_file_location("build_prebuilt_ext", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cpu_torch_is_refused_with_what_to_install() -> None:
    assert torch.version.cuda is None  # this machine; the build itself runs where CUDA torch is
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", "unused"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "CPU build" in result.stderr and "download.pytorch.org/whl/cu128" in result.stderr
    assert not (ROOT / "unused").exists()


def test_blackwell_needs_cuda_12_8() -> None:
    script = load_script()
    assert script.archs_for("12.6") == ("8.0", "8.6", "8.9", "9.0")
    assert script.archs_for("12.8") == script.ARCHS == ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
    assert script.archs_for("13.0") == script.ARCHS


def test_the_runtime_zip_unpacks_beside_torch_where_the_loader_finds_it(tmp_path: Path) -> None:
    script = load_script()
    stem = prebuilt.artifact_stem("2.13.0", "12.8")
    module, manifest = tmp_path / f"{stem}.so", tmp_path / f"{stem}.json"
    module.write_bytes(b"\x7fELF")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest.write_text(
        json.dumps(prebuilt.manifest_json(module.name, loader.sources_hash(), "2.13.0", "12.8", py, ["8.9"]))
    )
    archive = script.make_zip(module, manifest)
    site = tmp_path / "site-packages"
    unpack_wheel(archive, site)
    dirs = prebuilt.search_dirs(None, site / "torch")
    found, _ = prebuilt.find(dirs, prebuilt.Target(loader.sources_hash(), "2.13.0", "12.8", py, "8.9"))
    assert found is not None and found.module == site / prebuilt.RUNTIME_DIR_NAME / module.name
