"""The download manager against the fake Hub: every fault ends in a verified model or a clear error."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
from fake_hub import PatternBlob
from hub_helpers import FAST_RETRY, add_tiny_repo, wait_for

from engine.hub import downloads as downloads_mod
from engine.hub import transfer as transfer_mod
from engine.hub.client import HubClient
from engine.hub.downloads import DownloadManager, JobState
from engine.hub.library import COMPLETE_MARKER, PARTIAL_DIR, installed_models, is_complete

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def make_manager(tmp_path: Path, **kw) -> DownloadManager:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("stall_timeout", 2.0)
    kw.setdefault("progress_interval", 0.0)
    return DownloadManager(tmp_path / "models", client=HubClient(retry=FAST_RETRY), **kw)


def assert_matches_hub(hub, dest: Path, repo_id: str = "org/tiny", revision: str = "main") -> None:
    _, files = hub.repos[repo_id].resolve(revision)
    for path, blob in files.items():
        data = (dest / path).read_bytes()
        assert len(data) == blob.size
        assert hashlib.sha256(data).hexdigest() == blob.sha256, path
    assert is_complete(dest)
    assert not (dest / PARTIAL_DIR).exists()


def test_clean_download_is_verified_and_listed(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert snap.done_bytes == snap.total_bytes > 3 << 20
    assert_matches_hub(fake_hub, snap.dest)
    marker = json.loads((snap.dest / COMPLETE_MARKER).read_text())
    assert marker["commit"] == fake_hub.repos["org/tiny"].branches["main"]
    assert [m.repo_id for m in installed_models(tmp_path / "models")] == ["org/tiny"]
    # LFS files went through the CDN redirect, pinned to the commit rather than the branch name.
    commit = marker["commit"]
    assert fake_hub.requests_for(f"/org/tiny/resolve/{commit}/{SHARD1}")
    assert fake_hub.requests_for("/cdn-lfs/")


def test_branch_download_goes_to_its_own_folder(fake_hub, tmp_path):
    fake_hub.add_repo(
        "org/exl3",
        {"config.json": "{}", "README.md": "# main"},
        branches={"4.0bpw": {"config.json": "{}", "model.safetensors": PatternBlob(300_000, seed=9)}},
        tags=["exl3"],
    )
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/exl3", "4.0bpw"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert snap.dest.name == "org__exl3@4.0bpw"
    assert_matches_hub(fake_hub, snap.dest, "org/exl3", "4.0bpw")


def test_connection_dropped_mid_file_resumes_with_range(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD1, "drop", after=700_000, times=2)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert_matches_hub(fake_hub, snap.dest)
    ranges = [r.range for r in fake_hub.requests_for("/cdn-lfs/") if r.range]
    assert "bytes=700000-" in ranges and "bytes=1400000-" in ranges


def test_server_ignoring_range_restarts_the_file(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD1, "drop", after=500_000)
    fake_hub.fault(SHARD1, "ignore_range")
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert_matches_hub(fake_hub, snap.dest)


def test_retries_500_with_exponential_backoff(fake_hub, tmp_path, monkeypatch):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD2, "status", status=500, times=2)
    fake_hub.fault(SHARD2, "status", status=503, times=1)
    waits: list[float] = []
    real_wait = transfer_mod.SimpleControl.wait

    def recording_wait(self, seconds):
        waits.append(seconds)
        return real_wait(self, seconds)

    monkeypatch.setattr(transfer_mod.SimpleControl, "wait", recording_wait)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert waits == [0.01, 0.02, 0.04]  # base * 2**(n-1), jitter off in FAST_RETRY
    assert_matches_hub(fake_hub, snap.dest)


def test_persistent_500_fails_clearly_and_keeps_data(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD2, "status", status=502, times=None)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "HTTP 502" in snap.error and "giving up after 4" in snap.error
    assert not is_complete(snap.dest)
    assert installed_models(tmp_path / "models") == []
    # The first shard was verified and is kept for a resume.
    assert (snap.dest / PARTIAL_DIR / "parts" / (SHARD1 + ".part")).exists()
    fake_hub.clear_faults()
    m.resume(snap.id)
    snap = m.wait(snap.id, timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert not fake_hub.requests_for(f"{SHARD1}", "GET")[3:]  # shard 1 was not fetched again
    assert_matches_hub(fake_hub, snap.dest)


def test_429_retry_after_is_honoured(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD1, "status", status=429, retry_after="1")
    m = make_manager(tmp_path)
    import time

    t0 = time.monotonic()
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert time.monotonic() - t0 >= 0.95


def test_stall_without_bytes_times_out_and_resumes(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD1, "stall", after=200_000, seconds=30)
    m = make_manager(tmp_path, stall_timeout=0.5)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert "bytes=200000-" in [r.range for r in fake_hub.requests_for("/cdn-lfs/")]
    assert_matches_hub(fake_hub, snap.dest)


def test_corrupt_once_is_downloaded_again(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD1, "corrupt", at=12345)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert_matches_hub(fake_hub, snap.dest)


def test_hash_mismatch_fails_and_is_never_marked_complete(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD2, "corrupt", at=777, times=None)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "sha256 mismatch" in snap.error and SHARD2 in snap.error
    assert not is_complete(snap.dest)
    assert not (snap.dest / SHARD2).exists()
    assert not (snap.dest / PARTIAL_DIR / "parts" / (SHARD2 + ".part")).exists()  # corrupt data dropped
    assert installed_models(tmp_path / "models") == []


def test_corrupt_non_lfs_file_is_caught_by_git_blob_hash(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault("config.json", "corrupt", at=3, times=None)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "git-sha1 mismatch" in snap.error


def test_missing_repo_and_revision_are_clear_errors(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/nope"), timeout=30)
    assert snap.state == JobState.FAILED and "org/nope not found" in snap.error
    snap = m.wait(m.enqueue("org/tiny", "8.0bpw"), timeout=30)
    assert snap.state == JobState.FAILED and "revision '8.0bpw' not found in org/tiny" in snap.error


def test_gated_repo_without_token_fails_before_downloading(fake_hub, tmp_path):
    add_tiny_repo(fake_hub, "org/gated", gated="manual", tokens={"hf_goodtoken"})
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/gated"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "org/gated is gated" in snap.error and "HF_TOKEN" in snap.error
    assert f"{fake_hub.endpoint}/org/gated" in snap.error
    assert not fake_hub.requests_for("/org/gated/resolve/")


def test_gated_repo_token_without_access(fake_hub, tmp_path, monkeypatch):
    add_tiny_repo(fake_hub, "org/gated", gated="manual", tokens={"hf_goodtoken"})
    monkeypatch.setenv("HF_TOKEN", "hf_wrongtoken")
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/gated"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "does not have access" in snap.error
    assert "hf_wrongtoken" not in snap.error


def test_gated_repo_with_token_downloads_and_never_logs_it(fake_hub, tmp_path, monkeypatch, caplog):
    add_tiny_repo(fake_hub, "org/gated", gated="manual", tokens={"hf_goodtoken"})
    monkeypatch.setenv("HF_TOKEN", "hf_goodtoken")
    caplog.set_level(logging.DEBUG)
    m = make_manager(tmp_path)
    fake_hub.fault("config.json", "status", status=500)  # make the retry path log something
    snap = m.wait(m.enqueue("org/gated"), timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert all(r.authorized for r in fake_hub.requests_for("/org/gated/resolve/"))
    assert "hf_goodtoken" not in caplog.text
    assert "hf_goodtoken" not in repr(m.client) and "hf_goodtoken" not in repr(m.client.token())
    assert "hf_goodtoken" not in (tmp_path / "models" / "org__gated" / COMPLETE_MARKER).read_text()


def test_private_repo_needs_a_token(fake_hub, tmp_path):
    add_tiny_repo(fake_hub, "org/private", private=True, tokens={"hf_ok"})
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/private"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "org/private not found" in snap.error and "private" in snap.error


def test_free_space_is_checked_before_starting(fake_hub, tmp_path, monkeypatch):
    add_tiny_repo(fake_hub)
    monkeypatch.setattr(downloads_mod, "disk_free", lambda path: 1_000_000)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.FAILED
    total = sum(b.size for b in fake_hub.repos["org/tiny"].resolve("main")[1].values())
    assert f"({total} bytes) still to download" in snap.error
    assert "(1000000 bytes) free" in snap.error
    assert not fake_hub.requests_for("/resolve/")


def test_disk_filling_up_keeps_partial_data_for_resume(fake_hub, tmp_path, monkeypatch):
    add_tiny_repo(fake_hub)
    budget = {"left": 1_000_000}

    class FillingFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if budget["left"] < len(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            budget["left"] -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real_open = open
    monkeypatch.setattr(
        transfer_mod, "open", lambda p, mode="r", *a: FillingFile(real_open(p, mode, *a)), raising=False
    )
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "disk" in snap.error and "full" in snap.error
    parts = snap.dest / PARTIAL_DIR / "parts"
    kept = sum(p.stat().st_size for p in parts.iterdir())
    assert kept > 0
    monkeypatch.undo()
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.endpoint)
    m.resume(snap.id)
    snap = m.wait(snap.id, timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert_matches_hub(fake_hub, snap.dest)


def test_pause_keeps_data_and_resume_continues(fake_hub, tmp_path):
    add_tiny_repo(fake_hub, weight_mb=4)
    fake_hub.fault(SHARD1, "throttle", rate=4e6, times=None)
    m = make_manager(tmp_path)
    job = m.enqueue("org/tiny")
    wait_for(lambda: m.job(job).done_bytes > 300_000)
    m.pause(job)
    snap = m.wait(job, timeout=10)
    assert snap.state == JobState.PAUSED
    part = snap.dest / PARTIAL_DIR / "parts" / (SHARD1 + ".part")
    kept = part.stat().st_size
    assert 0 < kept < 2 << 20
    fake_hub.clear_faults()
    m.resume(job)
    snap = m.wait(job, timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert f"bytes={kept}-" in [r.range for r in fake_hub.requests_for("/cdn-lfs/")]
    assert_matches_hub(fake_hub, snap.dest)


def test_cancel_removes_partial_data(fake_hub, tmp_path):
    add_tiny_repo(fake_hub, weight_mb=4)
    fake_hub.fault(SHARD1, "throttle", rate=4e6, times=None)
    m = make_manager(tmp_path)
    job = m.enqueue("org/tiny")
    wait_for(lambda: m.job(job).done_bytes > 300_000)
    m.cancel(job)
    snap = m.wait(job, timeout=10)
    assert snap.state == JobState.CANCELLED
    assert not snap.dest.exists()
    assert installed_models(tmp_path / "models") == []


def test_progress_reports_speed_and_eta(fake_hub, tmp_path):
    add_tiny_repo(fake_hub, weight_mb=4)
    fake_hub.fault("*.safetensors", "throttle", rate=8e6, times=None)
    m = make_manager(tmp_path)
    seen = []
    m.add_listener(lambda e: seen.append(e.job) if e.kind == "progress" else None)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED
    moving = [s for s in seen if s.speed > 0]
    assert moving, "no speed was reported"
    assert all(s.eta is not None for s in moving)
    assert 2e6 < max(s.speed for s in moving) < 40e6
    done = [s.done_bytes for s in seen]
    assert done == sorted(done)  # per-job progress never goes backwards without a restart


def test_queue_runs_at_most_n_at_once(fake_hub, tmp_path):
    for name in ("org/a", "org/b", "org/c"):
        add_tiny_repo(fake_hub, name, weight_mb=1)
    fake_hub.fault("*.safetensors", "throttle", rate=4e6, times=None)
    m = make_manager(tmp_path, max_concurrent=2)
    lock = threading.Lock()
    running: set[str] = set()
    peak = [0]

    def listen(e):
        with lock:
            if e.job.state in (JobState.STARTING, JobState.DOWNLOADING, JobState.FINALIZING):
                running.add(e.job.id)
            else:
                running.discard(e.job.id)
            peak[0] = max(peak[0], len(running))

    m.add_listener(listen)
    ids = [m.enqueue(n) for n in ("org/a", "org/b", "org/c")]
    assert m.job(ids[2]).state == JobState.QUEUED
    for i in ids:
        assert m.wait(i, timeout=30).state == JobState.COMPLETED
    assert peak[0] == 2
    assert len(installed_models(tmp_path / "models")) == 3


def test_restart_after_crash_resumes_from_disk(fake_hub, tmp_path):
    """Files as a killed process leaves them (state file says running, part file half written):
    a new manager re-queues the job and continues with a Range request."""
    add_tiny_repo(fake_hub, weight_mb=4)
    fake_hub.fault(SHARD1, "throttle", rate=4e6, times=None)
    state = tmp_path / "queue.json"
    m1 = make_manager(tmp_path, state_path=state)
    job = m1.enqueue("org/tiny")
    wait_for(lambda: m1.job(job).done_bytes > 500_000)
    crash = tmp_path / "crash"
    dest = m1.job(job).dest
    shutil.copytree(dest, crash / "dest")
    shutil.copy(state, crash / "queue.json")
    m1.shutdown()
    shutil.rmtree(dest)
    shutil.copytree(crash / "dest", dest)
    shutil.copy(crash / "queue.json", state)
    saved = json.loads(state.read_text())
    assert saved["jobs"][0]["state"] == "queued"
    part_size = (dest / PARTIAL_DIR / "parts" / (SHARD1 + ".part")).stat().st_size
    assert part_size > 0

    fake_hub.clear_faults()
    m2 = make_manager(tmp_path, state_path=state)
    assert [j.id for j in m2.jobs()] == [job]
    snap = m2.wait(job, timeout=30)
    assert snap.state == JobState.COMPLETED, snap.error
    assert f"bytes={part_size}-" in [r.range for r in fake_hub.requests_for("/cdn-lfs/")]
    assert_matches_hub(fake_hub, dest)
    assert json.loads(state.read_text())["jobs"][0]["state"] == "completed"


def test_paused_and_failed_jobs_survive_a_restart(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    state = tmp_path / "queue.json"
    m1 = make_manager(tmp_path, state_path=state, autostart=False)
    a = m1.enqueue("org/tiny")
    m1.pause(a)
    b = m1.enqueue("org/missing")
    m1.start()
    assert m1.wait(b, timeout=30).state == JobState.FAILED
    m1.shutdown()
    m2 = make_manager(tmp_path, state_path=state)
    states = {j.id: j.state for j in m2.jobs()}
    assert states == {a: JobState.PAUSED, b: JobState.FAILED}
    assert "not found" in m2.job(b).error
    m2.remove(b)
    m2.resume(a)
    assert m2.wait(a, timeout=30).state == JobState.COMPLETED
    m2.shutdown()
    assert {j["id"] for j in json.loads(state.read_text())["jobs"]} == {a}


def test_completed_download_is_not_fetched_again(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    m = make_manager(tmp_path)
    m.wait(m.enqueue("org/tiny"), timeout=30)
    before = len(fake_hub.requests_for("/cdn-lfs/"))
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.COMPLETED
    assert len(fake_hub.requests_for("/cdn-lfs/")) == before


@pytest.mark.parametrize("bad", ["drop", "status"])
def test_unreachable_transfers_report_bytes_kept(fake_hub, tmp_path, bad):
    add_tiny_repo(fake_hub)
    if bad == "drop":
        fake_hub.fault(SHARD1, "drop", after=0, times=None)
    else:
        fake_hub.fault(SHARD1, "status", status=504, times=None)
    m = make_manager(tmp_path)
    snap = m.wait(m.enqueue("org/tiny"), timeout=30)
    assert snap.state == JobState.FAILED
    assert "kept for resume" in snap.error
