"""``generate --tp`` and ``--split-layers`` from the command line, and what a killed rank does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TRELLIS_DRAFT": "off"}


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory, tiny_llama_hf) -> Path:
    """A random tiny Llama with the fixtures' tokenizer whose greedy output never ends: the
    end-of-sequence token's logit is always 0, below the best of 2047 random logits."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from tiny_models import COMMON, build_tiny_model

    directory = tmp_path_factory.mktemp("endless")
    config = tf.LlamaConfig(**{**COMMON, "vocab_size": 2048, "max_position_embeddings": 4096})
    build_tiny_model("LlamaForCausalLM", directory, config=config)
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"][2] = 0
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_hf / name, directory / name)
    return directory


def _generate(model: Path, *extra: str) -> list[int]:
    command = [sys.executable, "-m", "engine", "generate", "-m", str(model), "-p", "Once upon a time"]
    done = subprocess.run(
        [*command, "-n", "24", "--device", "cpu", "--json", *extra],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["token_ids"]


@pytest.mark.slow
def test_tp_and_split_layers_give_the_same_tokens(endless_model) -> None:
    plain = _generate(endless_model)
    assert len(plain) == 24
    assert _generate(endless_model, "--tp", "2") == plain
    assert _generate(endless_model, "--split-layers", "1,3") == plain


def test_split_layers_must_cover_the_model(endless_model) -> None:
    command = [sys.executable, "-m", "engine", "generate", "-m", str(endless_model), "-p", "hi"]
    done = subprocess.run(
        [*command, "--device", "cpu", "--split-layers", "1,1"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert done.returncode == 2 and "add up to the model's 4 layers" in done.stderr


def _spawned_children(pid: int) -> list[int]:
    """The ranks ``pid`` spawned (torch.multiprocessing's spawn children, not its helpers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_killed_rank_ends_the_command_naming_it(endless_model) -> None:
    command = [sys.executable, "-m", "engine", "generate", "-m", str(endless_model), "-p", "Once upon a time"]
    proc = subprocess.Popen(
        [*command, "-n", "4000", "--device", "cpu", "--tp", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    try:
        started = threading.Event()

        def read_first() -> None:
            proc.stdout.read(1)  # the first streamed text: generation is under way
            started.set()

        threading.Thread(target=read_first, daemon=True).start()
        assert started.wait(90), "no output from generate --tp 2"
        (rank,) = _spawned_children(proc.pid)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=10)
        elapsed = time.monotonic() - killed
        stderr = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rank 1 was killed (SIGKILL)" in stderr
    assert elapsed < 5
