"""Timing helpers shared by the benchmark commands (wall clock around synchronised work)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def median_of(fn: Callable[[], float], repeats: int, warmup: int = 1) -> float:
    """Median of a figure ``fn()`` measures itself (e.g. a generator's own decode timing)."""
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(max(1, repeats)))


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    A large ``copy_`` (1 GiB on a GPU: far beyond any cache; 16 MiB on the CPU, enough there)
    is the practical ceiling of a memory-bound kernel: the denominator of the decode roofline.
    """
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (1 << 24))
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copies = 10  # per timed call, so the synchronisation around it is noise

    def copy() -> None:
        for _ in range(copies):
            dst.copy_(src)

    return 2 * copies * nbytes / median_time(copy, 5, device, warmup=1)
