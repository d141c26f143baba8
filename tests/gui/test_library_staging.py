"""Import staging folders never show up as models, and the app's startup reclaims abandoned ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fake_engine import make_model_dir

from app.library.scanner import model_dirs, scan

STARTER = "SmolLM2-135M-Instruct"


def dead_pid() -> int:
    """The PID of a process that has exited (and was reaped), so nothing owns it now."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


def staging_folder(models: Path, pid: int | None) -> Path:
    """A staging folder as an import leaves it: a full model's files, under the hidden name."""
    owner = f"{pid}-" if pid is not None else ""
    return make_model_dir(models / f".{STARTER}.importing-{owner}q1w2e3r4")


def test_scanner_never_lists_staging_folders(tmp_path) -> None:
    models = tmp_path / "models"
    real = make_model_dir(models / "org__real")
    stale = staging_folder(models, dead_pid())
    live = staging_folder(models, os.getpid())
    assert model_dirs(models) == [real]
    assert [i.path for i in scan([models])] == [real]
    # Nor when a staging folder is itself given as a folder (it is a complete-looking model).
    assert model_dirs(stale) == [] and model_dirs(live) == []
    assert scan([stale, live]) == []


def test_startup_removes_abandoned_staging_and_keeps_a_live_one(qtbot, store, tmp_path) -> None:
    from app.library.controller import LibraryController
    from app.library.model import LibraryModel
    from app.settings.settings import Settings

    models = tmp_path / "models"
    real = make_model_dir(models / "org__real")
    stale = staging_folder(models, dead_pid())
    live = staging_folder(models, os.getpid())
    controller = LibraryController(Settings(store), models, LibraryModel())
    assert not stale.exists()
    assert live.is_dir()  # an import of this process may be writing into it
    controller.refresh()
    assert [info.path for info in controller.model.infos()] == [real]
