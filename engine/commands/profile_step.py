"""``python -m engine profile-step``: where the time of a prefill and of decode steps goes.

Builds a random-weight model of a shape (as ``bench --synthetic`` does), runs one prefill of
``--prompt`` fresh tokens and ``--decode-tokens`` decode steps under ``torch.profiler``: eager by
default (every kernel is launched on its own), or replayed from CUDA graphs with ``--graphs`` (the
kernels and paths the app's decode really runs: e.g. paged decode attention), and prints the
kernels (on a CPU: the operators) that took the most time, with counts and time per call.
This is how ext/NOTES.md's step breakdowns were made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from engine.commands.common import run_alone


def register(sub) -> None:
    p = sub.add_parser("profile-step", help="kernel time breakdown of a prefill and of decode steps")
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


def run(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile

    from engine.commands.bench import synthetic_shape
    from engine.generation.generator import Generator
    from engine.generation.job import Job
    from engine.loading.synthetic_store import synthetic_model
    from engine.model import default_dtype, resolve_device

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
        gen = Generator(model, None, cache_tokens=tokens, max_batch_size=1, cuda_graphs=graphs)
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
            results["steps"].append({"step": label, "wall_ms": wall * 1e3, "total_ms": total, "top": rows})
            what = "kernel" if on_gpu else "operator"
            print(f"== {label}: wall {wall * 1e3:.1f} ms, {what} time {total:.1f} ms")
            for r in rows:
                print(f"  {r['ms']:9.2f} ms {r['calls']:6d}x {r['us_per_call']:9.1f} us  {r['name'][:100]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "profile-step", argv)


if __name__ == "__main__":
    sys.exit(main())
