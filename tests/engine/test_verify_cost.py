"""``bench --verify-cost``: the verify step table (k = 0..max_k per context), on the CPU."""

from __future__ import annotations

import pytest

from engine.bench.verify_cost import format_verify_costs, verify_step_costs


def test_verify_costs_cover_every_k_and_context(llama):
    rows = verify_step_costs(llama, [1, 40], batch=2, max_k=3, steps=2, repeats=1)
    assert [(r["context"], r["k"], r["rows"]) for r in rows] == [
        (c, k, 2 * (k + 1)) for c in (1, 40) for k in range(4)
    ]
    assert all(r["ms"] > 0 for r in rows)
    assert [r["ratio"] for r in rows if r["k"] == 0] == [1.0, 1.0]
    table = format_verify_costs("tiny", 2, rows)
    assert "context 40:" in table and "k=3" in table


def test_models_with_recurrent_state_are_refused(tiny_model_factory):
    from engine.model import load_model

    directory, _ = tiny_model_factory("Qwen3_5ForCausalLM")
    with pytest.raises(SystemExit, match="recurrent state"):
        verify_step_costs(load_model(directory, device="cpu"), [1], max_k=1, steps=1, repeats=1)
