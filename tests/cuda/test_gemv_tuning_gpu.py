"""The cluster GEMV's measured split count (engine.kernels.tuning) on the GPU: chosen once per
launch shape, outside graph captures, and a tuned call equals a call forced to that count."""

from __future__ import annotations

import gc

import pytest
import torch
from cuda_helpers import capture

from engine.kernels import gemv
from engine.kernels import tuning as gemv_tuning

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster GEMV needs sm_90")
    monkeypatch.setattr(gemv_tuning, "_enabled", True)
    gemv_tuning.forget()
    yield
    gemv_tuning.forget()


def _layer(in_f: int, outs: list[int], k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ts = [
        torch.randint(
            -(2**15), 2**15, (in_f // 16, o // 16, 16 * k), dtype=torch.int16, device="cuda", generator=g
        )
        for o in outs
    ]
    suhs = [(torch.rand(in_f, device="cuda", generator=g) + 0.5).half() for _ in outs]
    svhs = [(torch.rand(o, device="cuda", generator=g) + 0.5).half() for o in outs]
    return ts, suhs, svhs


def _chosen() -> dict:
    return dict(gemv_tuning._chosen)


@pytest.mark.parametrize("m", [1, 8])
def test_tuned_call_equals_the_forced_split_count(m):
    ts, suhs, svhs = _layer(4096, [4096, 1024, 1024], 4, m)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    tuned = gemv.exl3_gemv_multi(x, ts, suhs, svhs, "mul1")
    (chosen,) = _chosen().values()
    assert chosen in gemv_tuning.split_range(4096, 16, 16)
    forced = gemv.exl3_gemv_multi(x, ts, suhs, svhs, "mul1", splits=chosen)
    for a, b in zip(tuned, forced):
        assert torch.equal(a, b)


def test_each_launch_shape_is_timed_once(monkeypatch):
    ts, suhs, svhs = _layer(2048, [2048], 2, 0)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.float16)
    gemv.exl3_gemv(x, ts[0], suhs[0], svhs[0], "mcg")
    first = _chosen()
    assert len(first) == 1
    timed = []
    monkeypatch.setattr(gemv_tuning, "_measure", lambda *a: timed.append(a) or {})
    gemv.exl3_gemv(x, ts[0], suhs[0], svhs[0], "mcg")  # same shape: cached
    assert timed == [] and _chosen() == first
    x2 = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
    gemv.exl3_gemv(x2, ts[0], suhs[0], svhs[0], "mcg")  # two rows: another shape
    assert len(timed) == 1


def test_no_timing_inside_a_graph_capture(monkeypatch):
    ts, suhs, svhs = _layer(4096, [4096], 3, 1)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    seen = []
    real = gemv_tuning.tuned_splits

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append((torch.cuda.is_current_stream_capturing(), out))
        return out

    monkeypatch.setattr(gemv_tuning, "tuned_splits", spy)
    gemv_tuning.forget()
    # The capture helper warms up eagerly first: that call tunes, the captured one reuses it.
    graph, y = capture(lambda: gemv.exl3_gemv(x, ts[0], suhs[0], svhs[0], "3inst"))
    assert [c for c, _ in seen] == [False, True]
    assert seen[0][1] == seen[1][1] != 0
    eager = gemv.exl3_gemv(x, ts[0], suhs[0], svhs[0], "3inst")
    graph.replay()
    assert torch.equal(y, eager)
    # A shape first met inside a capture is not timed there: the kernel's choice (0).
    gemv_tuning.forget()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        g2 = torch.cuda.CUDAGraph()
        # Another dtype is another tuning shape; the kernel's own occupancy queries (cached by
        # rows and codebook) were made by the warm-up above, so nothing else runs in the capture.
        x3 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with torch.cuda.graph(g2):
            gemv.exl3_gemv(x3, ts[0], suhs[0], svhs[0], "3inst")
    assert seen[-1] == (True, 0)
    assert _chosen() == {}


def test_no_garbage_collection_inside_the_timing_captures():
    # An earlier model's CUDA graphs in reference cycles are destroyed whenever the collector next
    # runs; inside a capture that invalidates it (seen: a failed launch, once a crashed process).
    # With the threshold at 1 the collector would run at the first allocation of a launch.
    ts, suhs, svhs = _layer(512, [512, 128, 128], 4, 2)
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    for _ in range(3):  # forced split counts: no tuning here
        graph, _ = capture(lambda: gemv.exl3_gemv_multi(x, ts, suhs, svhs, "mul1", splits=1))
        cycle = {"graph": graph}
        cycle["self"] = cycle
    del graph, cycle
    during_capture = []

    def watch(phase, info):
        if phase == "start":
            during_capture.append(torch.cuda.is_current_stream_capturing())

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1)
    try:
        tuned = gemv.exl3_gemv_multi(x, ts, suhs, svhs, "mul1")  # times in captures
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert during_capture and not any(during_capture)  # it ran, and never inside a capture
    (chosen,) = _chosen().values()
    forced = gemv.exl3_gemv_multi(x, ts, suhs, svhs, "mul1", splits=chosen)
    for a, b in zip(tuned, forced):
        assert torch.equal(a, b)
