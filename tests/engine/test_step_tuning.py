"""Split counts tuned on whole decode steps (engine.kernels.tuning.tune_step) and the per-launch
tuner's records it builds on: the search, on made-up step times."""

from __future__ import annotations

import pytest
import torch

from engine.bench.speed import format_table
from engine.kernels import tuning
from engine.options import EngineOptions


def _key(in_features: int, outs: tuple[int, ...], bits: int = 4) -> tuple:
    mats = tuple((out // 16, 16 * bits) for out in outs)
    return ("cuda:0", 1, in_features, mats, "mul1", "int8", torch.bfloat16)


QKV, GATE_UP, O = _key(4096, (4096, 1024, 1024)), _key(4096, (14336, 14336)), _key(4096, (4096,))


@pytest.fixture(autouse=True)
def _clean():
    tuning.forget()
    yield
    tuning.forget()


def _measured(key: tuple, times: dict[int, float]) -> None:
    """As if the per-launch tuner had timed ``key`` alone: these times, the fastest chosen."""
    tuning._times[key] = dict(times)
    tuning.choose(key, min(times, key=times.get))


def _step(cost: dict[tuple, dict[int, float]], calls: list | None = None):
    """A step whose time is the sum over shapes of the chosen count's cost (ms)."""

    def time_step() -> float:
        choice = {k: tuning.choice(k) for k in cost}
        if calls is not None:
            calls.append(choice)
        return sum(cost[k][choice[k]] for k in cost)

    return time_step


def test_ranked_candidates_start_with_the_choice_then_go_by_time():
    _measured(QKV, {2: 5.0, 4: 3.0, 6: 3.5, 8: 4.0, 16: 9.0})
    assert tuning.ranked_candidates(QKV, 4) == [4, 6, 8, 2]
    tuning.choose(QKV, 8)  # revised by a step tuning: it comes first
    assert tuning.ranked_candidates(QKV, 3) == [8, 4, 6]
    assert tuning.ranked_candidates(O, 4) == []  # never timed


def test_each_shape_gets_the_count_that_makes_the_step_fastest():
    _measured(QKV, {2: 5.0, 4: 3.0, 6: 3.2, 8: 3.3})
    _measured(GATE_UP, {2: 10.0, 3: 10.5, 4: 12.0})
    # In the step the alone-fastest counts are not the best ones.
    cost = {QKV: {2: 1.0, 4: 1.0, 6: 0.8, 8: 0.9}, GATE_UP: {2: 4.0, 3: 3.5, 4: 3.9}}
    calls: list = []
    result = tuning.tune_step([QKV, GATE_UP], _step(cost, calls))
    assert tuning.choice(QKV) == 6 and tuning.choice(GATE_UP) == 3
    assert result.changes == {QKV: (4, 6), GATE_UP: (2, 3)}
    assert result.before_ms == pytest.approx(5.0) and result.after_ms == pytest.approx(4.3)
    # The larger launch goes first; each shape tries its ranked counts once (baseline + 2 + 3).
    assert calls[1][GATE_UP] == 3 and calls[1][QKV] == 4
    assert result.timings == len(calls) == 6


def test_a_change_within_the_noise_margin_is_not_taken():
    _measured(O, {4: 1.0, 8: 1.1})
    cost = {O: {4: 10.0, 8: 10.0 * (1 - tuning.MARGIN / 2)}}
    result = tuning.tune_step([O], _step(cost))
    assert tuning.choice(O) == 4 and result.changes == {}
    assert result.after_ms == result.before_ms == 10.0


def test_shapes_never_chosen_are_left_alone():
    _measured(QKV, {4: 1.0, 6: 2.0})
    cost = {QKV: {4: 2.0, 6: 1.0}}
    calls: list = []
    tuning.tune_step([QKV, O], _step(cost, calls))  # O has no choice (the kernel's own)
    assert tuning.choice(O) is None and tuning.choice(QKV) == 6


def test_a_step_shape_is_tuned_once_per_process():
    _measured(QKV, {4: 1.0, 6: 2.0})
    calls: list = []
    time_step = _step({QKV: {4: 2.0, 6: 1.0}}, calls)
    first = tuning.tune_step_once([QKV], time_step)
    assert first is not None and tuning.last_step_tuning() is first
    n = len(calls)
    assert tuning.tune_step_once([QKV], time_step) is None and len(calls) == n
    assert tuning.tune_step_once([], time_step) is None  # a step without tuned GEMVs


def test_recorded_keys_collect_the_launch_shapes_even_when_cached(monkeypatch):
    monkeypatch.setattr(tuning, "_enabled", True)
    monkeypatch.setattr(tuning, "_measure", lambda *a: {1: 2.0, 2: 1.0})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU-only torch
    x = torch.zeros(1, 256)
    t = torch.zeros(16, 8, 64, dtype=torch.int16)
    with tuning.recorded_keys() as keys:
        assert tuning.tuned_splits(x, [t], "mul1", "fp16", None, range(1, 3)) == 2  # timed
        assert tuning.tuned_splits(x, [t], "mul1", "fp16", None, range(1, 3)) == 2  # cached
    (key,) = keys
    assert tuning.ranked_candidates(key, 4) == [2, 1]
    with tuning.recorded_keys() as outer, tuning.recorded_keys() as inner:
        tuning.tuned_splits(x, [t], "mul1", "fp16", None, range(1, 3))
    assert outer == inner == {key}
    tuning.tuned_splits(x, [t], "mul1", "fp16", None, range(1, 3))  # no block open: no error


def test_summary_names_the_shapes_and_changes():
    result = tuning.StepTuning(3.12, 3.01, {GATE_UP: (2, 3)}, timings=9, seconds=4.2)
    text = result.summary()
    assert "3.120 -> 3.010 ms" in text and "[1x4096->14336@4+14336@4 mul1/int8] 2->3" in text
    assert "9 timings in 4.2 s" in text
    assert "no change" in tuning.StepTuning(1.0, 1.0).summary()


def test_step_tuning_is_opt_in():
    assert not EngineOptions().step_tuning
    assert EngineOptions.from_environment({"TRELLIS_STEP_TUNE": "1"}).step_tuning
    assert not EngineOptions.from_environment({"TRELLIS_STEP_TUNE": "0"}).step_tuning
    assert not EngineOptions.from_environment({}).step_tuning


def test_the_bench_table_reports_step_tuned_figures():
    row = {
        "label": "4 bpw",
        "decode_bytes_per_step": 5e9,
        "decode_tokens_per_s": 320.0,
        "decode_roofline_tokens_per_s": 1000.0,
        "decode_roofline_pct": 32.0,
        "decode_ctx_tokens_per_s": 280.0,
        "decode_ctx_roofline_tokens_per_s": 900.0,
        "decode_ctx_roofline_pct": 31.0,
        "prefill_tokens_per_s": 38000.0,
        "step_tuned_decode_tokens_per_s": 331.5,
        "step_tuned_decode_ctx_tokens_per_s": 290.25,
    }
    r = {
        "model": "synthetic llama3.1-8b",
        "device": "H200",
        "dtype": "bfloat16",
        "threads": 16,
        "copy_bandwidth_GBps": 4000.0,
        "batch": 1,
        "decode_tokens": 128,
        "cuda_graphs": True,
        "chained_launches": True,
        "context": 4096,
        "prompt_tokens": 4096,
        "rows": [row],
    }
    assert (
        "4 bpw with split counts tuned on whole steps: decode 331.5 tok/s, at context 290.2"
        in format_table(r)
    )
