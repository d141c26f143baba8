"""Integer bits per linear: a greedy knapsack over measured sensitivities, or by kind (issue 3).

Each linear ``l`` has ``n_l`` weights and an error curve ``e_l(K)`` (what quantizing it alone at
``K`` bits costs the model, :mod:`engine.convert.sensitivity`). We want integer ``K_l`` with
``sum n_l K_l <= target * sum n_l`` and ``sum e_l(K_l)`` as small as possible.

Every linear starts at the lowest K of the allowed range, then single bits are handed out one at a
time to the linear whose next bit buys the most error per weight, ``(e_l(K) - e_l(K+1)) / n_l``,
among those whose next bit still fits the budget. The curves are convex (each extra bit divides
the error by about four), so a linear's next bit is never worth more than its last one and the
greedy order is the order of a fractional optimum; only the last, partly fitting step can be off.

Without measurements (``allocation="uniform"``), :func:`allocate_bits` gives every linear
``floor(target)`` and hands the fractional extra bits out by a fixed kind priority.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.convert.errors import ConvertError

if TYPE_CHECKING:
    from engine.convert.slots import LinearSlot

# How far from floor(target) a linear may go: one bit below (the cheapest linears pay for the
# sensitive ones), two above (the sensitive ones; beyond that the returns are negligible).
BELOW = 1
ABOVE = 2
# Which projections get the extra bit first when the target is fractional: attention values and
# outputs and the MLP down projection are the most sensitive in published ablations; the wide
# gate/up projections are cheapest to keep at the lower K.
_BIT_PRIORITY = ("v", "o", "down", "k", "q", "gate", "up")


def k_range(target: float) -> tuple[int, int]:
    """The allowed integer K for a target: ``[max(1, floor - BELOW), min(8, floor + ABOVE)]``."""
    if not 1.0 <= target <= 8.0:
        raise ValueError(f"target bits per weight must be within 1.0..8.0, got {target}")
    base = int(math.floor(target))
    return max(1, base - BELOW), min(8, base + ABOVE)


def greedy_bits(sizes: Sequence[int], errors: Sequence[Callable[[int], float]], target: float) -> list[int]:
    """Integer K per linear (``sizes[i]`` weights, error curve ``errors[i](K)``) whose
    weight-averaged bits do not exceed ``target``. Ties go to the earlier linear."""
    if len(sizes) != len(errors):
        raise ValueError("one error curve per linear")
    lo, hi = k_range(target)
    bits = [lo] * len(sizes)
    total = sum(sizes)
    # Integer arithmetic for the budget: bits * weights are exact, the target is not.
    budget = math.floor(target * total + 1e-6) - lo * total

    def gain(i: int) -> float:
        return (errors[i](bits[i]) - errors[i](bits[i] + 1)) / sizes[i]

    heap = [(-gain(i), i) for i in range(len(sizes)) if lo < hi]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        if sizes[i] > budget:
            continue  # the budget only shrinks: this linear's next bit never fits
        bits[i] += 1
        budget -= sizes[i]
        if bits[i] < hi:
            heapq.heappush(heap, (-gain(i), i))
    return bits


def achieved_bits(sizes: Sequence[int], bits: Sequence[int]) -> float:
    """The weight-averaged bits of an allocation."""
    return sum(n * k for n, k in zip(sizes, bits)) / sum(sizes)


def bits_histogram(bits: Sequence[int]) -> str:
    """``'K=3: 40, K=4: 130'``: how many linears got each K (the converter's summary line)."""
    counts = {k: bits.count(k) for k in sorted(set(bits))}
    return ", ".join(f"K={k}: {n}" for k, n in counts.items())


def _bit_priority(kind: str) -> int:
    """Rank of a linear's kind in :data:`_BIT_PRIORITY`; kinds it does not list come last."""
    return _BIT_PRIORITY.index(kind) if kind in _BIT_PRIORITY else len(_BIT_PRIORITY)


def allocate_bits(slots: list[LinearSlot], target: float) -> float:
    """Integer K per tensor so the weight-averaged bits are as close to ``target`` as possible
    without exceeding it; extra bits go by :data:`_BIT_PRIORITY`, layer by layer. Returns the
    achieved average."""
    if not 1.0 <= target <= 8.0:
        raise ConvertError(f"target bits per weight must be within 1.0..8.0, got {target}")
    base = int(math.floor(target))
    sizes = [s.in_features * s.out_features for s in slots]
    total = sum(sizes)
    for s in slots:
        s.bits = base
    budget = target * total - base * total
    if base < 8:
        order = sorted(range(len(slots)), key=lambda i: _bit_priority(slots[i].kind))
        for i in order:
            if sizes[i] <= budget + 1e-6:
                slots[i].bits += 1
                budget -= sizes[i]
    return achieved_bits(sizes, [s.bits for s in slots])


__all__ = ["ABOVE", "BELOW", "achieved_bits", "allocate_bits", "bits_histogram", "greedy_bits", "k_range"]
