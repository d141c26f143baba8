"""Bit allocation: the greedy knapsack over sensitivities, the uniform (kind priority) allocation,
and the options/flags that choose between them."""

from __future__ import annotations

import pytest
import torch

from engine.convert.allocation import achieved_bits, allocate_bits, bits_histogram, greedy_bits, k_range
from engine.convert.mse import TRELLIS_MSE
from engine.convert.options import ConvertOptions
from engine.convert.slots import LinearSlot


def _curve(e_ref: float, k_ref: int = 4):
    return lambda k: e_ref * TRELLIS_MSE[k] / TRELLIS_MSE[k_ref]


def _random_problem(n: int = 40, seed: int = 0, spread: float = 30.0) -> tuple[list[int], list]:
    """Random sizes, and sensitivities spread log-uniformly over a factor ``spread``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(s) * 4096 for s in torch.randint(1, 12, (n,), generator=gen)]
    errors = [_curve(1e-4 * spread ** float(u)) for u in torch.rand(n, generator=gen)]
    return sizes, errors


def test_k_range() -> None:
    assert k_range(4.0) == (3, 6) and k_range(3.5) == (2, 5) and k_range(1.0) == (1, 3)
    assert k_range(8.0) == (7, 8) and k_range(7.2) == (6, 8)
    with pytest.raises(ValueError):
        k_range(0.5)


def test_more_bits_go_to_the_more_sensitive_of_two_equal_linears() -> None:
    sizes = [100, 100]
    for target in (3.0, 3.5, 4.0, 4.5, 5.0):
        bits = greedy_bits(sizes, [_curve(1e-3), _curve(1e-4)], target)
        assert bits[0] > bits[1]
        assert achieved_bits(sizes, bits) <= target
    # 4.5 bits: budget 3 bits over the floor-1 start of 3; each bit divides the error by ~4, so
    # the sensitive one takes two before the other gets one (10x/16 < 1x/1 for the third).
    assert greedy_bits(sizes, [_curve(1e-3), _curve(1e-4)], 4.5) == [5, 4]
    # Swapping the sensitivities swaps the bits.
    assert greedy_bits(sizes, [_curve(1e-4), _curve(1e-3)], 4.5) == [4, 5]


def test_budget_range_and_monotone_in_target() -> None:
    # Monotone while the K range does not bind; with sensitivities spread over 10^4 the floor of
    # the range (everyone >= floor(target) - 1) can cost more than the extra bits win.
    sizes, errors = _random_problem()
    total = sum(sizes)
    targets = [1.0 + 0.25 * i for i in range(29)]  # 1.0 .. 8.0
    previous_error = float("inf")
    previous_bits = 0.0
    for target in targets:
        bits = greedy_bits(sizes, errors, target)
        lo, hi = k_range(target)
        assert all(lo <= k <= hi for k in bits)
        got = achieved_bits(sizes, bits)
        # Within budget, and short of it by less than one step of the largest linear.
        assert got <= target + 1e-12
        assert target - got < max(sizes) / total
        err = sum(e(k) for e, k in zip(errors, bits))
        assert err <= previous_error * (1 + 1e-9) and got >= previous_bits - 1e-12
        previous_error, previous_bits = err, got
    assert greedy_bits(sizes, errors, 8.0) == [8] * len(sizes)


def test_greedy_beats_uniform_on_its_own_objective() -> None:
    sizes, errors = _random_problem(seed=1)
    for target in (3.0, 4.0):
        uniform = [int(target)] * len(sizes)
        greedy = greedy_bits(sizes, errors, target)
        assert sum(e(k) for e, k in zip(errors, greedy)) < sum(e(k) for e, k in zip(errors, uniform))


def test_bits_histogram() -> None:
    assert bits_histogram([4, 3, 4, 5]) == "K=3: 1, K=4: 2, K=5: 1"


def _slots() -> list[LinearSlot]:
    shapes = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64)}
    shapes.update({"gate": (64, 128), "up": (64, 128), "down": (128, 64)})
    return [
        LinearSlot(f"layers.{i}.{kind}", kind, None, kind, in_f, out_f)
        for i in range(2)
        for kind, (in_f, out_f) in shapes.items()
    ]


def test_uniform_allocation_is_the_kind_priority() -> None:
    # The old allocation, kept as allocation="uniform": floor(target) everywhere, extra bits by kind.
    slots = _slots()
    assert allocate_bits(slots, 4.0) == 4.0 and {s.bits for s in slots} == {4}
    slots = _slots()
    achieved = allocate_bits(slots, 4.25)
    # Budget 0.25 * 73728 = 18432 weights, spent in kind order (v, o, down, k, ...) over both
    # layers: v and o (12288), down does not fit (8192 > 6144), k does (4096), nothing else.
    assert achieved == 4 + 16384 / 73728
    assert [s.bits for s in slots[:7]] == [4, 5, 5, 5, 4, 4, 4] and [s.bits for s in slots[7:]] == [
        4,
        5,
        5,
        5,
        4,
        4,
        4,
    ]


def test_options_and_flags() -> None:
    import argparse

    from engine.bench import quality
    from engine.commands import convert

    options = ConvertOptions(bits=4.0)
    assert options.allocation == "sensitivity" and options.sensitivity_rows == 32
    key = options.job_key()
    assert key["allocation"] == "sensitivity" and key["sensitivity_rows"] == 32  # resume checks them
    assert ConvertOptions(bits=4.0, allocation="uniform").job_key() != key

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    convert.register(sub)
    quality.register(sub)
    args = parser.parse_args(["convert", "-i", "a", "-o", "b", "-b", "4"])
    assert args.allocation == "sensitivity" and args.sensitivity_rows == 32
    args = parser.parse_args(["convert", "-i", "a", "-o", "b", "-b", "4", "--allocation", "uniform"])
    assert args.allocation == "uniform"
    args = parser.parse_args(
        ["quality", "-m", "m", "--text-file", "t", "--allocation", "uniform", "--sensitivity-rows", "8"]
    )
    assert args.allocation == "uniform" and args.sensitivity_rows == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "-i", "a", "-o", "b", "-b", "4", "--allocation", "bogus"])
