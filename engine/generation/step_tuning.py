"""Split counts of the EXL3 GEMVs chosen by timing whole decode steps.

``engine.gemv_tuning`` times each GEMV launch shape alone, replayed from a graph of back-to-back
copies of itself. Inside a decode step a launch runs between other kernels: chained (the previous
kernel's tail overlaps its weight prefetch), with the L2 holding what the last kernel wrote, and
next to the attention and norm kernels' blocks. The count that is fastest alone need not be the
fastest there: for a Llama-3.2-1B shape the whole model's decode rate moved between 935 and 1030
tokens/s with the choice among counts that timed alike alone (docs/KERNELS.md, section 3.6).

So, once per set of launch shapes (a model's decode step at one batch size), this module revises
the choices against the objective that matters: it times the captured step with each shape's few
best counts in turn (coordinate descent, the largest shapes first, one pass) and keeps a change
only where the step got faster by more than the timing's noise. It costs a few graph captures per
shape (seconds for an 8B model) and is off unless asked for (``TRELLIS_STEP_TUNE=1``, the
Generator's ``tune_step_splits``, ``python -m engine bench --step-tune``) until it has earned its
place by measurement.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine import gemv_tuning

ENV = "TRELLIS_STEP_TUNE"
CANDIDATES_PER_SHAPE = 4  # the current count and the next best three, by their time alone
MARGIN = 0.003  # a change must make the step at least this much faster (replay noise ~0.1%)


def enabled() -> bool:
    """True when ``TRELLIS_STEP_TUNE`` asks for step tuning (anything but empty or 0)."""
    return os.environ.get(ENV, "") not in ("", "0")


@dataclass
class StepTuning:
    """What one tuning did: the step's time before and after (ms), the changed choices per launch
    shape (key -> (count alone, count in the step)), how many steps were timed, and how long it
    took (s)."""

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


def tune(keys: Sequence[tuple], time_step: Callable[[], float]) -> StepTuning:
    """Revise the split counts of ``keys`` (launch shapes of one decode step, already chosen by
    ``engine.gemv_tuning``) so that ``time_step()`` (ms of the step with the current choices)
    is lowest. Shapes without timed alternatives are left alone. Returns what changed."""
    t0 = time.perf_counter()
    best = time_step()
    result = StepTuning(before_ms=best, after_ms=best, timings=1)
    for key in sorted(keys, key=_weight, reverse=True):
        start = gemv_tuning.choice(key)
        if start is None:
            continue
        kept = start
        for splits in gemv_tuning.ranked_candidates(key, CANDIDATES_PER_SHAPE):
            if splits == kept:
                continue
            gemv_tuning.choose(key, splits)
            t = time_step()
            result.timings += 1
            if t < best * (1.0 - MARGIN):
                best, kept = t, splits
        gemv_tuning.choose(key, kept)
        if kept != start:
            result.changes[key] = (start, kept)
    result.after_ms = best
    result.seconds = time.perf_counter() - t0
    return result


_done: dict[frozenset, StepTuning] = {}  # key sets tuned in this process, and what it did


def tune_once(keys: Sequence[tuple], time_step: Callable[[], float]) -> StepTuning | None:
    """:func:`tune` the first time this set of launch shapes is met in the process (None after
    that: a second cache or Generator over the same model keeps the choices)."""
    ident = frozenset(keys)
    if not ident or ident in _done:
        return None
    _done[ident] = result = tune(keys, time_step)
    return result


def last() -> StepTuning | None:
    """The most recent tuning of the process (reports)."""
    return next(reversed(_done.values()), None)


def forget() -> None:
    """Forget which step shapes were tuned (tests)."""
    _done.clear()


__all__ = ["ENV", "StepTuning", "describe", "enabled", "forget", "last", "tune", "tune_once"]
