"""``python -m engine download`` / ``search`` end to end against the fake Hub, including kill -9."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import PatternBlob
from hub_helpers import add_tiny_repo, wait_for

from engine import cli
from engine.hub.library import PARTIAL_DIR, is_complete

ROOT = Path(__file__).resolve().parents[2]
# Runs the real dispatcher with only our subcommands registered, so these tests do not depend on
# the other subcommands' modules.
RUNNER = "import sys, engine.cli as c; c.COMMAND_MODULES = ['download', 'search']; sys.exit(c.main())"


@pytest.fixture
def only_hub_commands(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["download", "search"])


def test_cli_download_success(fake_hub, tmp_path, capsys, only_hub_commands):
    add_tiny_repo(fake_hub)
    dest = tmp_path / "out"
    assert cli.main(["download", "org/tiny", "--dir", str(dest)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(dest)
    assert "verified 5 files" in err and "completed" in err
    assert is_complete(dest)


def test_cli_download_failure_exits_2_with_message(fake_hub, tmp_path, capsys, only_hub_commands):
    add_tiny_repo(fake_hub, "org/gated", gated="manual")
    assert cli.main(["download", "org/gated", "--dir", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "error: org/gated is gated" in err


def test_cli_search_json_and_table(fake_hub, capsys, only_hub_commands):
    add_tiny_repo(fake_hub, "org/tiny-exl3", tags=["exl3"], downloads=3)
    add_tiny_repo(fake_hub, "org/tiny-fp16", downloads=7)
    assert cli.main(["search", "tiny", "--exl3", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [h["repo_id"] for h in hits] == ["org/tiny-exl3"]
    assert hits[0]["exl3"] and hits[0]["supported"]
    assert cli.main(["search", "tiny"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["model", "params", "downloads"]
    assert table[1].startswith("org/tiny-fp16") and "supported" in table[1]
    assert cli.main(["search", "x", "--min-params", "lots"]) == 2


def test_kill_9_mid_download_then_rerun_resumes(fake_hub, tmp_path):
    """A real ``python -m engine download`` process killed with SIGKILL, then run again."""
    size = 6 << 20
    fake_hub.add_repo("org/big", {"config.json": "{}", "model.safetensors": PatternBlob(size, seed=11)})
    fake_hub.fault("model.safetensors", "throttle", rate=3e6, times=1)
    dest = tmp_path / "big"
    env = {**os.environ, "HF_ENDPOINT": fake_hub.endpoint, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", RUNNER, "download", "org/big", "--dir", str(dest)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    part = dest / PARTIAL_DIR / "parts" / "model.safetensors.part"
    try:
        wait_for(lambda: part.exists() and part.stat().st_size > 1 << 20, timeout=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    kept = part.stat().st_size
    assert 0 < kept < size
    assert not is_complete(dest)

    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest)
    resumed = [r.range for r in fake_hub.requests_for("/cdn-lfs/") if r.range]
    assert resumed and int(resumed[-1].split("=")[1].rstrip("-")) >= kept - (1 << 20)
    blob = fake_hub.repos["org/big"].resolve("main")[1]["model.safetensors"]
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == blob.sha256
    assert is_complete(dest) and time.monotonic() - t0 < 60
