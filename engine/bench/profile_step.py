"""``python -m engine profile-step``: where the time of a prefill and of decode steps goes.

Builds a random-weight model of a shape (as ``bench --synthetic`` does), runs one prefill of
``--prompt`` fresh tokens and ``--decode-tokens`` decode steps under ``torch.profiler``: eager by
default (every kernel is launched on its own), or replayed from CUDA graphs with ``--graphs`` (the
kernels and paths the app's decode really runs: e.g. paged decode attention), and prints the
kernels (on a CPU: the operators) that took the most time, with counts and time per call.
docs/KERNELS.md's step breakdowns (section 11) come from it.

On a GPU it also prints each kernel's share of the critical path (:func:`critical_path`). Chained
launches (ext/chained_launch.cuh) start a kernel before its predecessor ends, so kernel times
overlap and their sum exceeds the wall time; what a kernel adds to a step is the time from the
moment everything before it had finished until it finishes itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.bench import help_for
from engine.commands.common import run_alone

IDLE = "(no kernel running)"


def register(sub) -> None:
    p = sub.add_parser("profile-step", help=help_for("profile-step"))
    p.add_argument("--synthetic", default="llama3.1-8b", help="shape name (engine.shapes) or config.json")
    p.add_argument("--bpw", type=int, default=4, help="EXL3 bits per weight (0: dense weights)")
    p.add_argument("--prompt", type=int, default=4096, help="prefill tokens")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=20, help="rows per table")
    p.add_argument("--graphs", action="store_true", help="decode from CUDA graphs, as the generator does")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="activation dtype (default: the device's)")
    p.add_argument("--json", default=None, help="write the tables as JSON here")
    p.set_defaults(func=run)


def _table(prof, on_gpu: bool, top: int) -> tuple[float, list[dict[str, Any]]]:
    events = prof.key_averages()

    def spent(e) -> float:  # microseconds on the device (GPU) or in the operator itself (CPU)
        return e.device_time_total if on_gpu else e.self_cpu_time_total

    total = sum(spent(e) for e in events)
    rows = [
        {"name": e.key, "calls": e.count, "ms": spent(e) / 1e3, "us_per_call": spent(e) / max(e.count, 1)}
        for e in sorted(events, key=spent, reverse=True)[:top]
        if spent(e) > 0
    ]
    return total / 1e3, rows


@dataclass
class CriticalPath:
    """Where the span of a stream's kernels went (see :func:`critical_path`)."""

    shares: dict[str, float] = field(default_factory=dict)  # name -> time charged to it
    gaps: list[tuple[float, str, str]] = field(default_factory=list)  # (idle time, kernel before, after)


def critical_path(kernels: Iterable[tuple[str, float, float]]) -> CriticalPath:
    """Each kernel name's share of the span from the first start to the last end, from
    ``(name, start, end)`` intervals of one stream: a kernel is charged the part of its interval
    after every kernel that started before it had ended (under chained launches: the time after
    its predecessor ended, not its wait). Gaps when no kernel runs are charged to :data:`IDLE`
    and listed with the kernels on either side. The shares sum to the span."""
    path = CriticalPath()
    frontier, last = None, ""
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        if frontier is None:
            frontier = start
        if start > frontier:
            path.shares[IDLE] = path.shares.get(IDLE, 0.0) + start - frontier
            path.gaps.append((start - frontier, last, name))
            frontier = start
        if end > frontier:
            path.shares[name] = path.shares.get(name, 0.0) + end - frontier
            frontier, last = end, name
    return path


def _critical_report(prof, top: int) -> dict[str, Any]:
    """:func:`critical_path` of the profiled kernels: the largest shares and the longest idle
    gaps (microseconds -> ms / us)."""
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    path = critical_path(kernels)
    ranked = sorted(path.shares.items(), key=lambda kv: kv[1], reverse=True)[:top]
    gaps = sorted(path.gaps, reverse=True)[:top]
    return {
        "shares": [{"name": name, "ms": us / 1e3} for name, us in ranked],
        "gaps": [{"us": us, "before": before, "after": after} for us, before, after in gaps],
        "gap_count": len(path.gaps),
    }


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from torch.profiler import ProfilerActivity, profile

    from engine.bench.speed import synthetic_shape
    from engine.generation.generator import Generator
    from engine.generation.job import Job
    from engine.loading.synthetic_store import synthetic_model
    from engine.model import default_dtype, resolve_device

    args.options.configure_kernels()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
    on_gpu = device.type == "cuda"
    name, config = synthetic_shape(args.synthetic)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results: dict[str, Any] = {"shape": name, "bits": args.bpw or None, "device": str(device), "steps": []}
    with torch.inference_mode():
        model = synthetic_model(config, args.bpw or None, device, dtype, 6, "mul1", name=name)
        tokens = args.prompt + args.decode_tokens + 256
        graphs = bool(args.graphs and on_gpu)
        options = replace(args.options, cuda_graphs=graphs)
        gen = Generator(model, None, cache_tokens=tokens, max_batch_size=1, options=options)
        vocab = model.spec.vocab_size
        rng = torch.Generator().manual_seed(0)

        def prompt(n: int) -> list[int]:  # fresh random tokens: no page of the cache can be reused
            return torch.randint(0, vocab, (n,), generator=rng).tolist()

        gen.generate([Job(prompt(args.prompt), 2, stop_token_ids=())])  # warm-up (kernels, allocator)
        if graphs:  # capture the decode graph outside the profiled steps
            gen.generate([Job(prompt(1), 4, stop_token_ids=())])
        sync()
        steps = (
            (f"prefill {args.prompt}", Job(prompt(args.prompt), 1, stop_token_ids=())),
            (f"decode {args.decode_tokens}", Job(prompt(1), args.decode_tokens + 1, stop_token_ids=())),
        )
        activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
        for label, job in steps:
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                gen.generate([job])
                sync()
                wall = time.perf_counter() - start
            total, rows = _table(prof, on_gpu, args.top)
            step = {"step": label, "wall_ms": wall * 1e3, "total_ms": total, "top": rows}
            results["steps"].append(step)
            what = "kernel" if on_gpu else "operator"
            print(f"== {label}: wall {wall * 1e3:.1f} ms, {what} time {total:.1f} ms")
            for r in rows:
                print(f"  {r['ms']:9.2f} ms {r['calls']:6d}x {r['us_per_call']:9.1f} us  {r['name'][:100]}")
            if on_gpu:
                report = step["critical_path"] = _critical_report(prof, args.top)
                print("  -- share of the critical path (time after everything before it had finished)")
                for r in report["shares"]:
                    print(f"  {r['ms']:9.2f} ms  {r['name'][:100]}")
                print(f"  -- longest of {report['gap_count']} idle gaps: us, kernel before -> after")
                for g in report["gaps"]:
                    print(f"  {g['us']:9.1f} us  {g['before'][:60]} -> {g['after'][:60]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "profile-step", argv)


if __name__ == "__main__":
    sys.exit(main())
