"""Import staging folders left by a killed process are reclaimed; live ones are never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from engine import staging
from engine.staging import (
    OWNED_IDLE_LIMIT,
    UNOWNED_IDLE_LIMIT,
    is_staging_dir,
    make_staging_dir,
    pid_alive,
    remove_stale_staging,
    staleness,
)

ROOT = Path(__file__).resolve().parents[2]
TARGET = "SmolLM2-135M-Instruct"


def killed_import(models: Path, target: str = TARGET) -> Path:
    """A real process makes a staging folder, writes into it and dies without cleaning up (as
    kill -9 or a power cut would leave it). Returns the folder; its owner PID is dead."""
    code = (
        "import os, sys; from pathlib import Path; from engine.staging import make_staging_dir; "
        "d = make_staging_dir(Path(sys.argv[1]) / sys.argv[2]); "
        "(d / 'config.json').write_text('{}'); (d / 'model.safetensors').write_bytes(b'x' * 4096); "
        "print(d, flush=True); os._exit(0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(models), target],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    folder = Path(done.stdout.strip())
    assert folder.is_dir() and folder.parent == models
    return folder


def age(path: Path, seconds: float) -> None:
    """Make the folder and everything directly in it look untouched for ``seconds``."""
    when = time.time() - seconds
    for p in [path, *path.iterdir()]:
        os.utime(p, (when, when))


def test_folder_of_a_killed_import_is_removed(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    stale = killed_import(models)
    pid = int(stale.name.split(".importing-")[1].split("-")[0])
    assert not pid_alive(pid)
    assert "is gone" in staleness(stale)
    assert remove_stale_staging(models) == [stale]
    assert not stale.exists()


def test_folder_of_a_live_owner_is_kept(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    live = make_staging_dir(models / TARGET)  # owned by this (live) test process
    (live / "model.safetensors").write_bytes(b"x")
    assert f".importing-{os.getpid()}-" in live.name
    assert staleness(live) is None
    assert remove_stale_staging(models) == []
    assert live.is_dir() and (live / "model.safetensors").exists()


def test_live_pid_with_nothing_written_for_a_day_is_a_reused_pid(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    folder = models / f".{TARGET}.importing-{os.getpid()}-abc123"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    age(folder, OWNED_IDLE_LIMIT - 3600)
    assert remove_stale_staging(models) == []
    age(folder, OWNED_IDLE_LIMIT + 60)
    assert remove_stale_staging(models) == [folder]


def test_folders_without_an_owner_go_once_idle(tmp_path):
    """Named as older versions named them (no PID): the 453 MB leak already on users' disks."""
    models = tmp_path / "models"
    models.mkdir()
    old = models / f".{TARGET}.importing-k2j4_x9q"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"x")
    age(old, UNOWNED_IDLE_LIMIT / 2)
    assert remove_stale_staging(models) == []  # could be an older build importing right now
    age(old, UNOWNED_IDLE_LIMIT + 60)
    assert remove_stale_staging(models) == [old]


def test_only_staging_folders_are_ever_removed(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setattr(staging, "pid_alive", lambda pid: False)  # every owner "dead"
    keep = [
        models / "org__model",
        models / ".trellis-partial",
        models / f"{TARGET}.importing-1-abc",  # not hidden: not our name
        models / "org__model" / f".{TARGET}.importing-1-abc",  # our name, but not a direct child
    ]
    for p in keep:
        p.mkdir(parents=True)
    (models / f".{TARGET}.importing-1-abc").mkdir()  # the one folder that goes
    (models / ".trellis-downloads.json").write_text("{}")
    file_like = models / f".{TARGET}.importing-2-abc"
    file_like.write_text("a file, not a folder")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (models / f".{TARGET}.importing-3-abc").symlink_to(elsewhere, target_is_directory=True)
    removed = remove_stale_staging(models)
    assert removed == [models / f".{TARGET}.importing-1-abc"]
    assert all(p.exists() for p in keep) and file_like.is_file() and elsewhere.is_dir()
    assert (models / ".trellis-downloads.json").is_file()
    assert (models / f".{TARGET}.importing-3-abc").is_symlink()


def test_target_filter_and_name_recognition(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    a = killed_import(models, "A")
    b = killed_import(models, "B")
    assert is_staging_dir(a) and is_staging_dir(b) and not is_staging_dir(models / "A")
    assert remove_stale_staging(models, "A") == [a]
    assert b.exists()
    assert remove_stale_staging(tmp_path / "missing") == []  # no folder: nothing to do, no error


def test_starter_setup_reclaims_a_killed_import(tmp_path, monkeypatch):
    """``ensure_starter_model`` (the app's first-run path) cleans before it looks, even when the
    starter is already in place and nothing is imported."""
    from engine import starter

    models = tmp_path / "models"
    models.mkdir()
    stale = killed_import(models)
    done = models / TARGET
    done.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (done / name).write_text("{}")
    monkeypatch.setattr(starter, "find_starter_gguf", lambda: (_ for _ in ()).throw(AssertionError))
    assert starter.ensure_starter_model(models) == done
    assert not stale.exists()
    assert sorted(p.name for p in models.iterdir()) == [TARGET]
