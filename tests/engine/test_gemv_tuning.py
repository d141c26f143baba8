"""The split-count tuner's pure parts (engine.kernels.tuning): candidate range and the pick."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.kernels import tuning as gemv_tuning


def test_split_range_follows_the_kernel_limits():
    # 4096 in features = 32 chunks: at least 2 splits (16 chunks per block), at most 16 (cluster).
    assert list(gemv_tuning.split_range(4096, 16, 16)) == list(range(2, 17))
    # 14336 = 112 chunks: at least 7 splits.
    assert list(gemv_tuning.split_range(14336, 16, 16)) == list(range(7, 17))
    # 512 = 4 chunks: no more splits than chunks.
    assert list(gemv_tuning.split_range(512, 16, 16)) == [1, 2, 3, 4]


def test_fastest_takes_the_lowest_time_and_skips_what_cannot_launch():
    times = {2: 5.0, 3: None, 4: 3.0, 5: 3.5, 6: None}
    assert gemv_tuning.fastest(list(times), times.get) == 4


def test_fastest_breaks_ties_toward_fewer_splits():
    assert gemv_tuning.fastest([2, 3, 4], lambda s: 1.0) == 2


def test_fastest_is_zero_when_nothing_launches():
    assert gemv_tuning.fastest([2, 3], lambda s: None) == 0


def test_tuning_off_leaves_the_choice_to_the_kernel(monkeypatch):
    monkeypatch.setattr(gemv_tuning, "_enabled", True)
    gemv_tuning.enable(False)  # EngineOptions(gemv_tuning=False).configure_kernels()
    assert not gemv_tuning.enabled()
    calls = []
    x = torch.zeros(1, 256)
    t = torch.zeros(16, 8, 64, dtype=torch.int16)
    got = gemv_tuning.tuned_splits(x, [t], "mul1", "fp16", lambda *a: calls.append(a), range(1, 3))
    assert got == 0 and calls == []


def test_engine_options_switch_tuning_for_the_process(monkeypatch):
    from engine.kernels import loader
    from engine.options import EngineOptions

    monkeypatch.setattr(gemv_tuning, "_enabled", True)
    monkeypatch.setattr(loader, "_settings", loader.settings())
    EngineOptions(gemv_tuning=False).configure_kernels()
    assert not gemv_tuning.enabled()
    EngineOptions().configure_kernels()
    assert gemv_tuning.enabled()


def test_cyclic_gc_paused_defers_collection_and_restores_the_collector():
    assert gc.isenabled()
    with gemv_tuning.cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with gemv_tuning.cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError), gemv_tuning.cyclic_gc_paused():
        raise ValueError("inside")
    assert gc.isenabled()
