"""Integer bits per linear from measured sensitivities: a greedy knapsack (issue 3).

Each linear ``l`` has ``n_l`` weights and an error curve ``e_l(K)`` (what quantizing it alone at
``K`` bits costs the model, :mod:`engine.quant.sensitivity`). We want integer ``K_l`` with
``sum n_l K_l <= target * sum n_l`` and ``sum e_l(K_l)`` as small as possible.

Every linear starts at the lowest K of the allowed range, then single bits are handed out one at a
time to the linear whose next bit buys the most error per weight, ``(e_l(K) - e_l(K+1)) / n_l``,
among those whose next bit still fits the budget. The curves are convex (each extra bit divides
the error by about four), so a linear's next bit is never worth more than its last one and the
greedy order is the order of a fractional optimum; only the last, partly fitting step can be off.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

# How far from floor(target) a linear may go: one bit below (the cheapest linears pay for the
# sensitive ones), two above (the sensitive ones; beyond that the returns are negligible).
BELOW = 1
ABOVE = 2


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


__all__ = ["ABOVE", "BELOW", "achieved_bits", "bits_histogram", "greedy_bits", "k_range"]
