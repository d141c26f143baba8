"""What a speculative verify step costs: a step that feeds each sequence its last token and ``k``
drafted ones, against the one-token decode step, at ``k`` = 0..8 (``bench --verify-cost``).

Drafting pays only where a verify step of ``1 + k`` tokens costs little more than a decode step
of one: a step that keeps ``a`` of ``k`` drafts on average yields ``1 + a`` tokens for the price of
the ``1 + k`` step. The steps measured are the ones the Generator runs: on a GPU replayed from the
CUDA graphs of the decode path (``engine.generation.cuda_graph``; a verify item is ``1 + k``
decode rows), elsewhere the fixed-shape decode path run eagerly. The same positions are
rewritten on every repeat, so the cache never grows while timing.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from engine.cache.paged import PagedKVCache
from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.decode_inputs import run_decode_step
from engine.generation.speculative.speculation import MAX_DRAFT_TOKENS
from engine.generation.step import StepItem, run_step

PAGE_SIZE = 64
PREFILL_CHUNK = 2048


def _items(tokens: list[list[int]], past: int, tables: list[list[int]], k: int) -> list[StepItem]:
    """Each sequence's verify item of ``1 + k`` tokens (a plain decode item at ``k`` = 0)."""
    return [
        StepItem(seq[past : past + k + 1], past, table, k + 1 if k else "last")
        for seq, table in zip(tokens, tables)
    ]


def _prefill(model, cache: PagedKVCache, tokens: list[int], table: list[int], length: int) -> None:
    for start in range(0, length, PREFILL_CHUNK):
        end = min(length, start + PREFILL_CHUNK)
        run_step(model.module, cache, [StepItem(tokens[start:end], start, table, None)])


@torch.inference_mode()
def verify_step_costs(
    model,
    contexts: list[int],
    batch: int = 1,
    max_k: int = MAX_DRAFT_TOKENS,
    steps: int = 20,
    repeats: int = 3,
    cache_bits: tuple[int, int] = (16, 16),
    graphs: bool = True,
) -> list[dict[str, Any]]:
    """One row per (context, ``k``): ms per step (median of ``repeats`` runs of ``steps`` steps) and
    its ratio to the ``k`` = 0 step at the same context."""
    device = model.device
    longest = max(contexts) + max_k + 1
    pages_per_seq = -(-longest // PAGE_SIZE)
    cache = PagedKVCache.for_model(
        model.spec,
        batch * pages_per_seq * PAGE_SIZE + PAGE_SIZE,
        PAGE_SIZE,
        model.dtype,
        device,
        cache_bits,
        batch,
        states=model.cache_states,
        devices=model.layer_devices,
    )
    if cache.state_slots.count:
        raise SystemExit("error: --verify-cost measures attention-only models (no recurrent state)")
    rng = torch.Generator().manual_seed(0)
    vocab = model.spec.vocab_size
    tokens = [torch.randint(0, vocab, (longest,), generator=rng).tolist() for _ in range(batch)]
    tables = [cache.pages.allocate(pages_per_seq) for _ in range(batch)]
    on_gpu = device.type == "cuda" and graphs
    replay = DecodeGraphs(model.module, cache, max_batch=batch * (1 + max_k)) if on_gpu else None

    def step(items: list[StepItem]) -> None:
        if replay is not None and replay.run(items) is not None:
            return
        run_decode_step(model.module, cache, items)

    def timed(items: list[StepItem]) -> float:
        step(items)  # capture (or warm up) outside the timing
        runs = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            for _ in range(steps):
                step(items)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append((time.perf_counter() - t) / steps)
        return sorted(runs)[len(runs) // 2]

    rows = []
    for context in contexts:
        for seq, table in zip(tokens, tables):
            _prefill(model, cache, seq, table, context)
        base = None
        for k in range(max_k + 1):
            seconds = timed(_items(tokens, context, tables, k))
            base = seconds if base is None else base
            rows.append(
                {
                    "context": context,
                    "k": k,
                    "rows": batch * (k + 1),
                    "ms": seconds * 1e3,
                    "ratio": seconds / base,
                }
            )
            print(f"  verify k={k} at {context}: {seconds * 1e3:.3f} ms", file=sys.stderr, flush=True)
    if replay is not None and replay.failed:
        print(f"note: CUDA graphs failed ({replay.failed}); steps ran eagerly", file=sys.stderr)
    return rows


def format_verify_costs(label: str, batch: int, rows: list[dict[str, Any]]) -> str:
    """A table per context: ``k``, decode rows, ms per step and the ratio to ``k`` = 0."""
    lines = [f"{label}: verify step cost, batch {batch} (k drafted tokens per sequence)"]
    for context in sorted({r["context"] for r in rows}):
        at = [r for r in rows if r["context"] == context]
        lines.append(
            f"  context {context}: " + "  ".join(f"k={r['k']} {r['ms']:.3f} ms {r['ratio']:.2f}x" for r in at)
        )
    return "\n".join(lines)
