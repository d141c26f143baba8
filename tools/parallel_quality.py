"""Several ``python -m engine quality`` jobs at once on one GPU, summarised per variant (a device tool).

Device minutes are scarce and a device call lasts at most 10 minutes, so A/B measurements of the
converter run as one batch of jobs: one job per (variant, seed or bits), each with its own work
folder, JSON and log under ``--out``. Side by side they gain little: seven SmolLM2 conversions at
once took about as long as one after another (the converter keeps the GPU busy, so a second
process only time-slices with it), so size a batch by the sum of its jobs' serial times. What the
batch does give: a job that runs out of time keeps its finished blocks in its work folder, and the
same batch run again (same jobs in the same order, same ``--work``) resumes every job where it
stopped. A conversion is deterministic per seed whatever runs beside it (measured: a job repeated
from a serial run gave the same figures to the last digit).

  python tools/parallel_quality.py --model DIR --text eval.txt --out OUT [--parallel 7] \\
      "base|--bpw 4 --seeds 0" "mine|--bpw 4 --seeds 0 --cal-text /data/cal" ...

Each job is ``variant|quality arguments``; ``--ctx 512 --device cuda --dtype float32`` and (without
a ``--gguf`` of its own) ``--gguf ''`` are added. It prints every scored row and each variant's mean
per bits per weight, and writes the summary (``--summary``, and a copy in OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_job(index: int, variant: str, args: str, ns: argparse.Namespace) -> dict:
    """One quality run; its rows (none if it failed or ran out of time)."""
    stem = Path(ns.out) / f"{variant}_{index}"
    cmd = [sys.executable, "-m", "engine", "quality", "-m", ns.model, "--text-file", ns.text]
    cmd += ["--ctx", "512", "--device", ns.device, "--dtype", "float32"]
    cmd += ["--work", f"{ns.work}/{variant}_{index}", "--json", f"{stem}.json", *args.split()]
    if "--gguf" not in args.split():
        cmd += ["--gguf", ""]
    env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads))
    t0 = time.perf_counter()
    with open(f"{stem}.log", "w", encoding="utf-8") as log:
        try:
            rc: int | str = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=ns.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    result = Path(f"{stem}.json")
    rows = json.loads(result.read_text())["rows"] if result.is_file() else []
    print(f"job {index} {variant} [{args}] rc={rc} wall={wall:.0f} s", flush=True)
    return {"variant": variant, "args": args, "rc": rc, "wall": wall, "rows": rows}


def summarize(results: list[dict]) -> dict:
    """Per variant: its scored rows (EXL3 and GGUF, each with the job's arguments), the unquantized
    perplexity, and the mean ppl change and KL of its EXL3 rows per bits per weight."""
    summary: dict = {}
    for r in results:
        v = summary.setdefault(r["variant"], {"rows": [], "unquantized": None, "means": {}})
        for row in r["rows"]:
            if row["kind"] == "unquantized":
                v["unquantized"] = row["ppl"]
            elif row["kind"] == "exl3" or row["kind"].startswith("gguf"):
                v["rows"].append(row | {"job_args": r["args"]})
    for v in summary.values():
        by_bpw: dict = {}
        for row in v["rows"]:
            if row["kind"] == "exl3":
                by_bpw.setdefault(row["bpw"], []).append(row)
        for bpw, rows in sorted(by_bpw.items()):
            v["means"][str(bpw)] = {
                "ppl_delta_pct": sum(x["ppl_delta_pct"] for x in rows) / len(rows),
                "mean_kl": sum(x["mean_kl"] for x in rows) / len(rows),
                "n": len(rows),
            }
    return summary


def table(summary: dict) -> str:
    lines = [
        "| variant | row | ppl | ppl vs unquantized | mean KL | conversion s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, v in summary.items():
        for row in v["rows"]:
            seconds = f"{row['convert_s']:.1f}" if row.get("convert_s") else "-"
            lines.append(
                f"| {name} | {row['name']} [{row['job_args']}] | {row['ppl']:.4f} "
                f"| {row['ppl_delta_pct']:+.2f}% | {row['mean_kl']:.5f} | {seconds} |"
            )
        for bpw, m in v["means"].items():
            mean = f"{m['ppl_delta_pct']:+.2f}% | {m['mean_kl']:.5f}"
            lines.append(f"| {name} | mean of {m['n']} at {bpw} bpw | - | {mean} | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="unquantized HF model directory")
    p.add_argument("--text", required=True, help="evaluation text file")
    p.add_argument("--out", required=True, help="folder for each job's JSON and log")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parallel", type=int, default=6, help="jobs at once (default 6)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per job (default 2)")
    p.add_argument("--timeout", type=int, default=520, help="seconds a job may take (default 520)")
    p.add_argument("--work", default="/tmp/parallel_quality", help="parent of the jobs' work folders")
    p.add_argument("--summary", default="/tmp/parallel_quality.json", help="where the summary goes")
    p.add_argument("jobs", nargs="+", metavar="VARIANT|ARGS")
    ns = p.parse_args(argv)
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    jobs = [job.split("|", 1) for job in ns.jobs]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(ns.parallel) as pool:
        results = list(pool.map(lambda item: run_job(item[0], *item[1], ns), enumerate(jobs)))
    print(f"{len(jobs)} jobs in {time.perf_counter() - t0:.0f} s wall", flush=True)
    summary = summarize(results)
    print(table(summary))
    text = json.dumps(summary, indent=1)
    Path(ns.summary).write_text(text)
    (Path(ns.out) / Path(ns.summary).name).write_text(text)


if __name__ == "__main__":
    main()
