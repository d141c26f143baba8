"""File names from the Hub's listing never reach the disk outside the model folder.

The fake Hub serves repositories whose listings name hostile paths; every such download must be
refused as a whole, before a byte is written, with an error that names the path.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from fake_hub import PatternBlob
from hub_helpers import FAST_RETRY

from engine import cli
from engine.hub.client import HubClient
from engine.hub.downloads import DownloadManager, JobState
from engine.hub.errors import HubError, UnsafeRepoPathError
from engine.hub.library import COMPLETE_MARKER, PARTIAL_DIR, PLAN_FILE, is_complete, model_dir_name
from engine.safe_paths import UnsafePathError

HOSTILE = [
    "../../x",
    "a/../../b",
    "../x.bin",
    "C:\\x",
    "C:x",
    "a\\..\\b",
    "a\x00b",
    "config.json\x00../../x",
    "a//b",
    "./a",
    "line\nbreak",
    PARTIAL_DIR + "/parts/config.json.part",
    COMPLETE_MARKER,
]


def all_files(root: Path) -> set[Path]:
    """Every file and link under ``root`` (the test's whole tmp_path, parents of the models folder
    included), except huggingface_hub's own home."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and "hf_home" in dirnames:
            dirnames.remove("hf_home")
        out.update(Path(dirpath) / n for n in filenames + dirnames)
    return out


def make_manager(tmp_path: Path) -> DownloadManager:
    # Nested, so that "../" and "../../" from the model folder land in folders this test watches.
    return DownloadManager(
        tmp_path / "a" / "b" / "models",
        client=HubClient(retry=FAST_RETRY),
        retry=FAST_RETRY,
        stall_timeout=2.0,
        progress_interval=0.0,
    )


def add_evil_repo(hub, name: str, repo_id: str = "org/evil") -> None:
    hub.add_repo(repo_id, {"config.json": "{}", name: b"pwned by " + name.encode(), "zz.bin": b"z" * 10})


def assert_refused(hub, tmp_path: Path, snap, name: str, before: set[Path]) -> None:
    assert snap.state == JobState.FAILED
    assert repr(name) in snap.error, snap.error  # names the offending path, printable
    assert "refusing to download org/evil@main" in snap.error
    assert "\n" not in snap.error
    assert not hub.requests_for("/resolve/")  # not a byte was even asked for
    assert not hub.requests_for("/cdn-lfs/")
    assert not snap.dest.exists()  # nothing written, not even the plan
    assert all_files(tmp_path) == before  # nothing anywhere else either


@pytest.mark.parametrize("name", HOSTILE, ids=repr)
def test_hostile_names_refuse_the_whole_download(fake_hub, tmp_path, name):
    add_evil_repo(fake_hub, name)
    m = make_manager(tmp_path)
    before = all_files(tmp_path)
    snap = m.wait(m.enqueue("org/evil"), timeout=30)
    assert_refused(fake_hub, tmp_path, snap, name, before)


def test_absolute_name_is_refused_and_its_target_untouched(fake_hub, tmp_path):
    # An absolute path the test can watch (writing to the real "/abs/path" is not ours to try).
    victim = tmp_path / "victim" / "path"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    add_evil_repo(fake_hub, str(victim))
    m = make_manager(tmp_path)
    before = all_files(tmp_path)
    snap = m.wait(m.enqueue("org/evil"), timeout=30)
    assert_refused(fake_hub, tmp_path, snap, str(victim), before)
    assert "absolute" in snap.error
    assert victim.read_bytes() == b"precious"


def test_one_hostile_name_refuses_even_when_include_skips_it(fake_hub, tmp_path):
    add_evil_repo(fake_hub, "../../x")
    m = make_manager(tmp_path)
    before = all_files(tmp_path)
    snap = m.wait(m.enqueue("org/evil", include=["config.json"]), timeout=30)
    assert_refused(fake_hub, tmp_path, snap, "../../x", before)


def test_symlink_inside_the_destination_cannot_lead_out(fake_hub, tmp_path):
    fake_hub.add_repo("org/evil", {"config.json": "{}", "sub/file.bin": b"pwned"})
    m = make_manager(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = m.dest_for("org/evil")
    dest.mkdir(parents=True)
    (dest / "sub").symlink_to(outside, target_is_directory=True)
    snap = m.wait(m.enqueue("org/evil"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "'sub/file.bin'" in snap.error and "leads outside" in snap.error
    assert list(outside.iterdir()) == []
    assert not (dest / PARTIAL_DIR).exists()
    assert not fake_hub.requests_for("/resolve/")


def test_a_saved_plan_with_a_hostile_name_is_not_resumed(fake_hub, tmp_path):
    """A plan written before names were checked (or edited) is checked like a fresh listing."""
    fake_hub.add_repo("org/evil", {"config.json": "{}"})
    m = make_manager(tmp_path)
    dest = m.dest_for("org/evil")
    plan = {
        "repo_id": "org/evil",
        "revision": "main",
        "include": None,
        "commit": fake_hub.repos["org/evil"].branches["main"],
        "gated": False,
        "files": [{"path": "../../x", "size": 2, "sha256": None, "blob_id": "0" * 40, "verified": True}],
        "created": 0.0,
    }
    (dest / PARTIAL_DIR).mkdir(parents=True)
    (dest / PARTIAL_DIR / PLAN_FILE).write_text(json.dumps(plan))
    before = all_files(tmp_path)
    snap = m.wait(m.enqueue("org/evil"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "'../../x'" in snap.error and "saved plan is not used" in snap.error
    assert all_files(tmp_path) == before
    assert not fake_hub.requests_for("/resolve/")


def test_nested_legitimate_names_still_download(fake_hub, tmp_path):
    blob = PatternBlob(300_000, seed=5)
    fake_hub.add_repo(
        "org/nested",
        {"config.json": "{}", "sub/dir/file.bin": blob, "a..b/c.d..e.txt": "dots are fine inside names"},
    )
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/nested"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    data = (snap.dest / "sub" / "dir" / "file.bin").read_bytes()
    assert hashlib.sha256(data).hexdigest() == blob.sha256
    assert (snap.dest / "a..b" / "c.d..e.txt").read_text() == "dots are fine inside names"
    assert is_complete(snap.dest)


def test_the_error_is_typed_and_names_the_path(fake_hub, tmp_path):
    add_evil_repo(fake_hub, "a/../../b")
    m = make_manager(tmp_path)
    job = m._jobs[m.enqueue("org/evil")]  # the error object itself, as _run sees it
    m.wait(job.id, timeout=30)
    with pytest.raises(UnsafeRepoPathError) as info:
        m._load_or_make_plan(job)
    assert isinstance(info.value, HubError) and isinstance(info.value, UnsafePathError)
    assert info.value.name == "a/../../b"


@pytest.mark.parametrize("repo_id", ["..", ".", "../..", "org/..", ".trellis-downloads.json"])
def test_model_folder_from_a_repo_id_stays_in_the_models_folder(tmp_path, repo_id):
    m = DownloadManager(tmp_path / "models", autostart=False)
    dest = m.dest_for(repo_id)
    assert dest.parent == tmp_path / "models"
    assert not model_dir_name(repo_id).startswith(".")
    assert dest.name not in ("", ".", "..")


@pytest.fixture
def only_download_command(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["download"])


@pytest.mark.parametrize("quiet", [True, False])
def test_cli_refuses_with_one_error_line(fake_hub, tmp_path, capsys, only_download_command, quiet):
    add_evil_repo(fake_hub, "../../x")
    dest = tmp_path / "out" / "evil"
    before = all_files(tmp_path)
    argv = ["download", "org/evil", "--dir", str(dest), "--retries", "2"] + (["--quiet"] if quiet else [])
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0]
    assert "'../../x'" in errors[0] and "Traceback" not in err
    assert "resume" not in err  # nothing was written, so nothing to resume
    if quiet:
        assert len(lines) == 1
    assert all_files(tmp_path) == before
