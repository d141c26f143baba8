"""``bench --synthetic SHAPE --tp N``: every rank builds the same seeded random-weight model and
keeps its shard, so the run computes the single-process model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from parallel_cases import assert_logits_close, step_logits
from test_bench_synthetic import SMALL_RUN, TINY

from engine.bench import speed as bench
from engine.loading.synthetic_store import synthetic_model
from engine.parallel.launch import start_tensor_parallel


def test_synthetic_ranks_build_the_same_model() -> None:
    spec = {"hf_config": TINY, "bits": 4, "head_bits": 6, "codebook": "mul1", "name": "tiny", "seed": 0}
    reference = step_logits(synthetic_model(**spec, device="cpu", dtype=torch.float32))
    model, run, _ = start_tensor_parallel(None, 2, "cpu", torch.float32, synthetic=spec)
    with run:
        assert_logits_close(step_logits(model), reference)


@pytest.mark.slow
def test_synthetic_bench_over_two_ranks(tmp_path) -> None:
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps(TINY))
    out = tmp_path / "b.json"
    args = ["--synthetic", str(shape), "--bpw", "4", "--tp", "2", "--no-peer", "--json", str(out)]
    assert bench.main([*args, "--device", "cpu", *SMALL_RUN]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tp"] == 2 and row["bits"] == 4 and row["decode_ctx_tokens_per_s"] > 0
