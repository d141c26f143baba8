"""Split-K choice of the v5 EXL3 GEMV, measured once per launch shape.

Why measure: the kernel's own choice (ext/exl3_gemv_v5.cu ``v5_choose_splits``) models a launch
as waves x (chunks per block + fixed cost). On the H200 that model is off by up to 9% for the
Llama-8B shapes (docs/KERNELS.md, section 3.6: gate/up 44.0 us at its 3 splits vs 40.4 at 2; q/k/v
15.9 at 6 vs 14.4 at 4), because blocks sharing an SM, cluster placement within a GPC and each
block's fixed cost do not follow it, and they differ by GPU. So the first eager call of each
launch shape times every split count that can launch, on random matrices of that shape (enough
copies that they do not sit in L2, as the real layers' weights do not), replayed from a CUDA graph
so that the host's launch rate does not hide the kernel's time, and keeps the fastest.

A launch shape is (device, rows, in features, each matrix's out features and bits, codebook,
variant, dtype): a model has a handful (q/k/v, o, gate/up, down, head, x rows 1-8). Tuning costs
a few milliseconds per shape and happens in the first decode step, before the CUDA graphs are
captured (their warm-up runs eagerly); a call while a graph is being captured never tunes, it
takes the kernel's choice. ``TRELLIS_GEMV_TUNE=0`` turns tuning off (the kernel's model decides).

Within a process a shape always gets the same split count, so eager and graph-replayed calls stay
bit-identical; another process may choose differently where two counts time alike (the outputs
then differ in the order of fp32 additions only).

A launch timed alone is not a launch between the other kernels of a decode step (chained, with
the previous kernel's tail and the next one's weight prefetch beside it), so
``engine.generation.step_tuning`` can revise the choices by timing whole steps: it learns a step's
launch shapes from :func:`recorded_keys`, tries each shape's best few counts from
:func:`ranked_candidates` through :func:`choose`, and keeps what makes the step fastest.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

TUNE = os.environ.get("TRELLIS_GEMV_TUNE", "1") not in ("", "0")
# Bytes of matrices the timing cycles through: above the H200's 50 MB L2, so it reads from DRAM
# as a model's layers do. The launch's own matrices are one copy; random ones make up the rest
# (at most this many bytes more, for a moment).
_ROTATION_BYTES = 64 << 20
_MAX_COPIES = 16
_WARMUP = 2
_ROUNDS = 5

_chosen: dict[tuple, int] = {}
_times: dict[tuple, dict[int, float]] = {}  # key -> split count -> ms of the timed graph
_recording: list[set[tuple]] = []  # the key sets of the open recorded_keys() blocks


def split_range(in_features: int, max_chunks_per_split: int, max_cluster: int) -> range:
    """The split counts a v5 launch of ``in_features`` accepts (each split's chunks must fit the
    block's shared memory; a split is one block of the cluster)."""
    chunks = in_features // 128
    return range(-(-chunks // max_chunks_per_split), min(chunks, max_cluster) + 1)


def fastest(candidates: Sequence[int], time_one: Callable[[int], float | None]) -> int:
    """The candidate with the lowest time; ``time_one`` returns None for one that cannot launch.
    Ties go to the smaller split count (fewer blocks). 0 (the kernel's choice) if none ran."""
    best, best_t = 0, math.inf
    for s in candidates:
        t = time_one(s)
        if t is not None and t < best_t:
            best, best_t = s, t
    return best


def tuned_splits(
    x: torch.Tensor,
    trellises: Sequence[torch.Tensor],
    codebook: str,
    variant: str,
    launch: Callable[..., None],
    candidates: range,
) -> int:
    """The split count for this launch shape (0: leave it to the kernel). ``launch(x, trellises,
    suhs, svhs, ys, splits)`` runs the GEMV; ``candidates`` are the split counts to try; ``variant``
    names the kernel ("exact", "fast", "int8"): each has its own fastest count."""
    if not TUNE:
        return 0
    key = (
        x.device,
        x.shape[0],
        x.shape[1],
        tuple((t.shape[1], t.shape[2]) for t in trellises),
        codebook,
        variant,
        x.dtype,
    )
    for keys in _recording:
        keys.add(key)
    chosen = _chosen.get(key)
    if chosen is not None:
        return chosen
    if torch.cuda.is_current_stream_capturing():
        return 0  # no timing inside a capture; the graph keeps the kernel's choice
    from engine import ops  # ops imports this module lazily

    # Unchained: the timing copies were just written by kernels, and a chained GEMV may fetch its
    # first weight rows before the previous kernel has finished.
    with ops.chained_launches(x.device, enabled=False):
        times = _measure(x, trellises, launch, candidates)
    chosen = fastest(candidates, times.get)
    _chosen[key], _times[key] = chosen, times
    return chosen


def _measure(
    x: torch.Tensor, trellises: Sequence[torch.Tensor], launch, candidates: range
) -> dict[int, float]:
    """ms of the graph of every copy's launch, per split count that launches (none: no room)."""
    device = x.device
    per_copy = sum(t.numel() * t.element_size() for t in trellises)
    copies = max(1, min(_MAX_COPIES, math.ceil(_ROTATION_BYTES / max(per_copy, 1))))
    in_f = x.shape[1]
    try:
        mats = [list(trellises)] + [
            [torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, device=device) for t in trellises]
            for _ in range(copies - 1)
        ]
    except torch.OutOfMemoryError:  # no room for the timing copies: the kernel's model decides
        return {}
    suhs = [torch.ones(in_f, dtype=torch.float16, device=device) for _ in trellises]
    svhs = [torch.ones(t.shape[1] * 16, dtype=torch.float16, device=device) for t in trellises]
    ys = [torch.empty(x.shape[0], t.shape[1] * 16, dtype=x.dtype, device=device) for t in trellises]
    stream = torch.cuda.current_stream(device)

    def time_one(splits: int) -> float | None:
        try:
            for i in range(_WARMUP):
                launch(x, mats[i % copies], suhs, svhs, ys, splits)
        except RuntimeError:  # e.g. clusters of this size cannot be launched on this GPU
            return None
        # Replayed from a graph: issued eagerly, a small launch (a 1B model's GEMVs take 5-10 us)
        # is timed at the host's launch rate, and the choice between close counts became noise.
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(stream)
        with cyclic_gc_paused(), torch.cuda.stream(side):
            graph.capture_begin()
            try:
                for m in mats:
                    launch(x, m, suhs, svhs, ys, splits)
            finally:
                graph.capture_end()
        stream.wait_stream(side)
        graph.replay()
        return replay_ms(graph, stream, _ROUNDS)

    times = {}
    for s in candidates:
        t = time_one(s)
        if t is not None:
            times[s] = t
    return times  # the copies are freed on return


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (around a raw graph capture). An earlier model's CUDA
    graph that waits in a reference cycle is destroyed when the collector next runs; inside a
    capture that destruction is forbidden: it invalidates the capture (the launch after it fails)
    and was seen to crash the process. ``torch.cuda.graph`` collects before its captures; this
    capture is one of many small ones, so it defers the collection instead."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, replays: int) -> float:
    """ms per replay of ``graph`` over ``replays`` back-to-back replays on ``stream`` (warmed up
    by the caller), timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(replays):
        graph.replay()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / replays


@contextmanager
def recorded_keys() -> Iterator[set[tuple]]:
    """Inside, every tuned launch adds its launch shape (key) to the yielded set."""
    keys: set[tuple] = set()
    _recording.append(keys)
    try:
        yield keys
    finally:
        _recording.remove(keys)


def choice(key: tuple) -> int | None:
    """The split count launches of ``key`` run with (None: not chosen yet)."""
    return _chosen.get(key)


def choose(key: tuple, splits: int) -> None:
    """Make launches of ``key`` run with ``splits`` from now on (a count the launch accepts)."""
    _chosen[key] = splits


def ranked_candidates(key: tuple, limit: int) -> list[int]:
    """Up to ``limit`` split counts of ``key``, fastest first by their time alone, starting with
    the current choice (where one was timed)."""
    times = _times.get(key, {})
    ranked = sorted(times, key=lambda s: (times[s], s))
    current = _chosen.get(key)
    if current in times:
        ranked.remove(current)
        ranked.insert(0, current)
    return ranked[:limit]


def forget() -> None:
    """Drop every measured choice (tests; a changed GPU clock)."""
    _chosen.clear()
    _times.clear()
