"""Split counts of the cluster split-K EXL3 GEMV: measured once per launch shape, and revised by
timing whole decode steps.

**Per launch shape.** The kernel's own choice (ext/exl3_gemv_cluster.cu ``choose_splits``) models
a launch as waves x (chunks per block + fixed cost). On the H200 that model is off by up to 9% for
the Llama-8B shapes (docs/KERNELS.md, section 3.6: gate/up 44.0 us at its 3 splits vs 40.4 at 2;
q/k/v 15.9 at 6 vs 14.4 at 4), because blocks sharing an SM, cluster placement within a GPC and
each block's fixed cost do not follow it, and they differ by GPU. So the first eager call of each
launch shape times every split count that can launch, on random matrices of that shape (enough
copies that they do not sit in L2, as the real layers' weights do not), replayed from a CUDA graph
so that the host's launch rate does not hide the kernel's time, and keeps the fastest.

A launch shape is (device, rows, in features, each matrix's out features and bits, codebook,
variant, dtype): a model has a handful (q/k/v, o, gate/up, down, head, x rows 1-16). Tuning costs
a few milliseconds per shape and happens in the first decode step, before the CUDA graphs are
captured (their warm-up runs eagerly); a call while a graph is being captured never tunes, it
takes the kernel's choice. :func:`enable` turns tuning off (``EngineOptions.gemv_tuning``): the
kernel's model decides.

Within a process a shape always gets the same split count, so eager and graph-replayed calls stay
bit-identical; another process may choose differently where two counts time alike (the outputs
then differ in the order of fp32 additions only).

**Per decode step.** A launch timed alone is not a launch between the other kernels of a decode
step: chained (the previous kernel's tail overlaps its weight prefetch), with the L2 holding what
the last kernel wrote, next to the attention and norm kernels' blocks. The count that is fastest
alone need not be the fastest there: for a Llama-3.2-1B shape the whole model's decode rate moved
between 935 and 1030 tokens/s with the choice among counts that timed alike alone
(docs/KERNELS.md, section 3.6). So :func:`tune_step` revises the choices of one step's launch
shapes (learnt with :func:`recorded_keys`) against the objective that matters: it times the
captured step with each shape's few best counts in turn (coordinate descent, the largest shapes
first, one pass) and keeps a change only where the step got faster by more than the timing's
noise. It costs a few graph captures per shape (seconds for an 8B model) and is opt-in
(``EngineOptions.step_tuning``, ``python -m engine bench --step-tune``): it measured +1.9% on the
1B shape and within noise on the 8B, and two runs chose differently between close counts.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.kernels import loader

# Bytes of matrices the timing cycles through: above the H200's 50 MB L2, so it reads from DRAM
# as a model's layers do. The launch's own matrices are one copy; random ones make up the rest
# (at most this many bytes more, for a moment).
_ROTATION_BYTES = 64 << 20
_MAX_COPIES = 16
_WARMUP = 2
_ROUNDS = 5

_enabled = True
_chosen: dict[tuple, int] = {}
_times: dict[tuple, dict[int, float]] = {}  # key -> split count -> ms of the timed graph
_recording: list[set[tuple]] = []  # the key sets of the open recorded_keys() blocks


def enable(on: bool) -> None:
    """Time split counts per launch shape (on, the default) or leave them to the kernel (off)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def split_range(in_features: int, max_chunks_per_split: int, max_cluster: int) -> range:
    """The split counts a cluster GEMV launch of ``in_features`` accepts (each split's chunks must
    fit the block's shared memory; a split is one block of the cluster)."""
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
    names the kernel ("fp16", "int8"): each has its own fastest count."""
    if not _enabled:
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
    # Unchained: the timing copies were just written by kernels, and a chained GEMV may fetch its
    # first weight rows before the previous kernel has finished.
    with loader.chained_launches(x.device, enabled=False):
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
    """Drop every measured choice and which steps were tuned (tests; a changed GPU clock)."""
    _chosen.clear()
    _times.clear()
    _steps_done.clear()


# -- whole decode steps -----------------------------------------------------------------------

CANDIDATES_PER_SHAPE = 4  # the current count and the next best three, by their time alone
MARGIN = 0.003  # a change must make the step at least this much faster (replay noise ~0.1%)


@dataclass
class StepTuning:
    """What one step tuning did: the step's time before and after (ms), the changed choices per
    launch shape (key -> (count alone, count in the step)), how many steps were timed, and how
    long it took (s)."""

    before_ms: float
    after_ms: float
    changes: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    timings: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        moved = ", ".join(f"{describe(k)} {a}->{b}" for k, (a, b) in self.changes.items()) or "no change"
        return (
            f"decode step {self.before_ms:.3f} -> {self.after_ms:.3f} ms "
            f"({moved}; {self.timings} timings in {self.seconds:.1f} s)"
        )


def describe(key: tuple) -> str:
    """A launch shape in words: rows x in -> the matrices' out features at K bits."""
    _device, rows, in_features, mats, codebook, variant, _dtype = key
    outs = "+".join(f"{out * 16}@{words // 16}" for out, words in mats)
    return f"[{rows}x{in_features}->{outs} {codebook}/{variant}]"


def _weight(key: tuple) -> int:
    """Weights the launch reads (its matrices' in x out): the order shapes are tuned in."""
    _device, _rows, in_features, mats, *_ = key
    return sum(in_features * out * 16 for out, _words in mats)


def tune_step(keys: Sequence[tuple], time_step: Callable[[], float]) -> StepTuning:
    """Revise the split counts of ``keys`` (launch shapes of one decode step, already chosen per
    launch) so that ``time_step()`` (ms of the step with the current choices) is lowest. Shapes
    without timed alternatives are left alone. Returns what changed."""
    t0 = time.perf_counter()
    best = time_step()
    result = StepTuning(before_ms=best, after_ms=best, timings=1)
    for key in sorted(keys, key=_weight, reverse=True):
        start = choice(key)
        if start is None:
            continue
        kept = start
        for splits in ranked_candidates(key, CANDIDATES_PER_SHAPE):
            if splits == kept:
                continue
            choose(key, splits)
            t = time_step()
            result.timings += 1
            if t < best * (1.0 - MARGIN):
                best, kept = t, splits
        choose(key, kept)
        if kept != start:
            result.changes[key] = (start, kept)
    result.after_ms = best
    result.seconds = time.perf_counter() - t0
    return result


_steps_done: dict[frozenset, StepTuning] = {}  # key sets tuned in this process, and what it did


def tune_step_once(keys: Sequence[tuple], time_step: Callable[[], float]) -> StepTuning | None:
    """:func:`tune_step` the first time this set of launch shapes is met in the process (None
    after that: a second cache or Generator over the same model keeps the choices)."""
    ident = frozenset(keys)
    if not ident or ident in _steps_done:
        return None
    _steps_done[ident] = result = tune_step(keys, time_step)
    return result


def last_step_tuning() -> StepTuning | None:
    """The most recent step tuning of the process (reports)."""
    return next(reversed(_steps_done.values()), None)
