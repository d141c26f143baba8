"""Helpers shared by the Hub tests (and the GUI tests of the hub/download panes)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from fake_hub import FakeHub, PatternBlob, tiny_llama_config

from engine.hub.retry import RetryPolicy

FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05, jitter=0.0)


def add_tiny_repo(hub: FakeHub, repo_id: str = "org/tiny", weight_mb: float = 3, **meta) -> None:
    """A small Llama-style repo: config, card, tokenizer json and two LFS weight shards."""
    size = int(weight_mb * (1 << 20))
    files = {
        "config.json": json.dumps(tiny_llama_config()),
        "README.md": "---\nlicense: apache-2.0\n---\n# Tiny\n\nA *tiny* model.\n",
        "tokenizer.json": json.dumps({"model": {"vocab": {"a": 0}}}),
        "model-00001-of-00002.safetensors": PatternBlob(size // 2, seed=1),
        "model-00002-of-00002.safetensors": PatternBlob(size - size // 2, seed=2),
    }
    meta.setdefault("card_data", {"license": "apache-2.0"})
    hub.add_repo(repo_id, files, **meta)


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, interval: float = 0.01) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError("condition not reached in time")
