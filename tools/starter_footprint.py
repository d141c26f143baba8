"""Disk, memory and CPU speed of model directories: load time, resident memory after load and after
a reply, and greedy decode tok/s at given thread counts; optionally the greedy replies' agreement
with a reference directory (tokens equal before the first difference).

    python tools/starter_footprint.py DIR [DIR ...] [--threads 1 2] [--dtype bfloat16]
        [--reference DIR] [--new-tokens 128] [--json OUT]

Each measurement runs in a fresh process (resident memory is per process). Resident memory counts
the whole process: Python, torch and the tokenizer as well (the ``base`` column: before the load).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The starter-model prompts of the test suite.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five uses of a paperclip and explain each one.",
    "What is the capital of France? Answer in one word.",
    "Name three colours of the rainbow.",
    "Who wrote Hamlet?",
    "What is 2+2?",
    "Tell me a joke.",
]

_CHILD = r"""
import json, os, sys, time
import torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.tokenizer import Tokenizer
if cfg["per_call"]:  # int8 weights dequantized per call: the kernel's fallback
    import engine.modules.int8 as int8_module
    int8_module._kernel = lambda: None

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
directory, dtype, new, prompts = cfg["dir"], cfg["dtype"], cfg["new"], cfg["prompts"]
tok = Tokenizer.from_dir(directory)
base = rss()
t0 = time.perf_counter()
model = load_model(directory, device="cpu", dtype=dtype)
load_s = time.perf_counter() - t0
loaded = rss()
gen = Generator(model, tok, cache_tokens=2048)
ids = tok.encode_chat([{"role": "user", "content": prompts[3]}])
(r,) = gen.generate([Job(ids, new, stop_token_ids=())])
replies = [x.token_ids for x in gen.generate([Job(tok.encode_chat([{"role": "user", "content": p}]), 64)
                                               for p in prompts])] if cfg["replies"] else []
print(json.dumps(dict(load_s=load_s, base=base, loaded=loaded, after_reply=rss(), new_tokens=r.new_tokens,
                      tok_s=r.timings.tokens_per_second(r.new_tokens), params=model.parameter_bytes(),
                      replies=replies)))
"""


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def measure(
    directory: Path, threads: int, dtype: str | None, new: int, replies: bool, per_call: bool
) -> dict:
    cfg = dict(dir=str(directory), threads=threads, dtype=dtype, new=new, prompts=PROMPTS, replies=replies)
    cfg["per_call"] = per_call
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cfg)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def agreement(ours: list[int], reference: list[int]) -> tuple[int, int]:
    """(tokens equal before the first difference, the reference's length)."""
    same = 0
    for a, b in zip(ours, reference):
        if a != b:
            break
        same += 1
    return same, len(reference)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--dtype", default=None, help="compute dtype (default: the engine's, float32 on the CPU)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--reference", type=Path, help="also compare greedy replies to the 10 prompts with this one"
    )
    p.add_argument(
        "--per-call", action="store_true", help="int8 weights: dequantize per call, not the kernel"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    mib = 1024**2
    results = {}
    reference = measure(args.reference, 2, None, 2, True, False)["replies"] if args.reference else None
    print(
        f"{'model':<28}{'thr':>4}{'disk MiB':>10}{'params MiB':>11}{'load s':>8}{'base MiB':>10}"
        f"{'loaded':>8}{'+reply':>8}{'tok/s':>7}"
    )
    for directory in args.dirs:
        for i, threads in enumerate(args.threads):
            r = measure(
                directory,
                threads,
                args.dtype,
                args.new_tokens,
                reference is not None and i == 0,
                args.per_call,
            )
            results[f"{directory}@{threads}"] = r
            sizes = (disk_bytes(directory), r["params"], r["base"], r["loaded"], r["after_reply"])
            disk, params, base, loaded, after = (n / mib for n in sizes)
            print(
                f"{directory.name:<28}{threads:>4}{disk:>10.1f}{params:>11.1f}{r['load_s']:>8.2f}"
                f"{base:>10.0f}{loaded:>8.0f}{after:>8.0f}{r['tok_s']:>7.1f}",
                flush=True,
            )
            if r["replies"]:
                pairs = [agreement(a, b) for a, b in zip(r["replies"], reference)]
                r["agreement"] = pairs
                print(
                    "  greedy agreement with the reference (same tokens / reference tokens):",
                    " ".join(f"{a}/{b}" for a, b in pairs),
                    f"identical {sum(a == b for a, b in pairs)}/10",
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
