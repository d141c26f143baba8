"""``cache-capacity``: how many tokens of KV cache fit a memory budget at each bit width.

Reads only config.json (no weights), so it answers for any model directory, even one whose
weights are not downloaded yet.
"""

from __future__ import annotations

import argparse
import json

from engine.cache.paged import kv_bytes_per_token
from engine.cache.state import KVPages, LatentPages
from engine.commands.common import finite_float

SETTINGS = [(16, 16), (8, 8), (6, 6), (4, 6), (4, 4), (3, 3), (2, 2)]


def capacity_table(spec, budget_bytes: int, dense_bytes: int = 2) -> list[dict]:
    rows = []
    for k, v in SETTINGS:
        per_token = kv_bytes_per_token(spec, (k, v), dense_bytes)
        rows.append(
            {"k_bits": k, "v_bits": v, "bytes_per_token": per_token, "max_tokens": budget_bytes // per_token}
        )
    return rows


def register(sub) -> None:
    p = sub.add_parser("cache-capacity", help="max context per KV-cache bit width for a memory budget")
    p.add_argument("-m", "--model", required=True, help="model directory (only config.json is read)")
    p.add_argument(
        "--budget-gb", type=finite_float(0.0, low_open=True), default=8.0, help="memory for the cache, GiB"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.architectures import architecture_for
    from engine.config import ModelConfig
    from engine.layers import sequence_states

    cfg = ModelConfig.from_dir(args.model)
    spec = architecture_for(cfg.architecture).spec(cfg)
    rows = capacity_table(spec, int(args.budget_gb * 2**30))
    if args.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]["max_tokens"]
    states = sequence_states(spec)
    kv = next((s for s in states if isinstance(s, KVPages)), None)
    if kv is not None:
        print(f"{cfg.architecture}: {spec.num_layers} layers, {kv.kv_heads} KV heads x {kv.head_dim}")
    else:  # latent attention: one row per position instead of keys and values (max of K,V bits)
        row = next(s for s in states if isinstance(s, LatentPages))
        print(f"{cfg.architecture}: {spec.num_layers} layers, a latent row of {row.width} per position")
    print(
        f"{'k/v bits':<10}{'bytes/token':>12}{'max tokens':>12}{'vs fp16':>9}  (budget {args.budget_gb} GiB)"
    )
    for r in rows:
        label = f"{r['k_bits']}/{r['v_bits']}" if r["k_bits"] < 16 else "fp16"
        print(f"{label:<10}{r['bytes_per_token']:>12}{r['max_tokens']:>12}{r['max_tokens'] / base:>8.2f}x")
    return 0
