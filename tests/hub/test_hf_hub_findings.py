"""What huggingface_hub itself does on a bad download (the findings in engine.hub.downloads).

If an upgrade of huggingface_hub changes one of these, the docstring there (and maybe the code that
makes up for it) needs another look.
"""

from __future__ import annotations

import hashlib

import pytest
from hub_helpers import add_tiny_repo
from huggingface_hub import hf_hub_download

SHARD = "model-00001-of-00002.safetensors"


def test_hf_hub_download_does_not_verify_the_hash(fake_hub, tmp_path):
    add_tiny_repo(fake_hub)
    fake_hub.fault(SHARD, "corrupt", at=100, times=None)
    path = hf_hub_download(
        "org/tiny", SHARD, cache_dir=tmp_path / "c", endpoint=fake_hub.endpoint, token=False
    )
    blob = fake_hub.repos["org/tiny"].resolve("main")[1][SHARD]
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() != blob.sha256  # corrupt data accepted silently


def test_hf_hub_download_discards_partial_data_on_failure(fake_hub, tmp_path, monkeypatch):
    add_tiny_repo(fake_hub)
    monkeypatch.setattr("time.sleep", lambda s: None)  # its fixed 1 s waits between retries
    fake_hub.fault(SHARD, "drop", after=300_000, times=None)
    with pytest.raises(Exception):  # noqa: B017 - whichever error it raises, what matters is the disk
        hf_hub_download("org/tiny", SHARD, cache_dir=tmp_path / "c", endpoint=fake_hub.endpoint, token=False)
    leftovers = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert not [p for p in leftovers if p.name.endswith(".incomplete")]  # nothing to resume from
    gets = fake_hub.requests_for("/cdn-lfs/")
    # 1 try + 5 retries, each from byte 0: bytes of a 10 MiB chunk not yet complete when the
    # connection dropped are thrown away, so its in-call "resume" starts over here.
    assert len(gets) == 6
    assert all(r.range is None for r in gets)
