"""One forward step over several sequences at once (the unit continuous batching schedules)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.paged import PagedKVCache
from engine.modules.batch import BatchLayout, SequenceSlice
from engine.modules.decoder import CausalLM


@dataclass
class StepItem:
    """Feed ``tokens`` to a sequence that already has ``past`` positions in the cache.

    ``logits``: ``"last"`` for the next-token distribution after the last token, ``"all"`` for
    one row per token (scoring), ``None`` when the step only fills the cache (a prefill chunk).
    """

    tokens: Sequence[int]
    past: int
    block_table: Sequence[int]
    logits: str | None = "last"


@torch.inference_mode()
def run_step(model: CausalLM, cache: PagedKVCache, items: Sequence[StepItem]) -> list[torch.Tensor | None]:
    device = model.device
    ids, positions, write_slots, sequences, logit_rows = [], [], [], [], []
    spans: list[tuple[int, int] | None] = []
    row = 0
    for item in items:
        n = len(item.tokens)
        end = item.past + n
        slots = cache.slots(item.block_table, 0, end)
        ids.extend(item.tokens)
        positions.append(torch.arange(item.past, end))
        write_slots.append(slots[item.past :])
        sequences.append(SequenceSlice(row, n, item.past, slots))
        first = len(logit_rows)
        if item.logits == "last":
            logit_rows.append(row + n - 1)
        elif item.logits == "all":
            logit_rows.extend(range(row, row + n))
        spans.append((first, len(logit_rows)) if item.logits else None)
        row += n
    batch = BatchLayout(sequences, torch.cat(positions).to(device), torch.cat(write_slots))
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
    logits = model(input_ids, batch, cache, rows)  # always run: a prefill chunk fills the cache
    return [None if span is None else logits[span[0] : span[1]] for span in spans]


@torch.inference_mode()
def score_tokens(
    model: CausalLM, cache: PagedKVCache, token_ids: Sequence[int], chunk: int = 512
) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` for one sequence, prefilled in chunks.

    Uses (and afterwards releases) pages of ``cache``; the result does not depend on ``chunk``.
    """
    pages = cache.pages.allocate(-(-len(token_ids) // cache.page_size))
    try:
        out = []
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start : start + chunk]
            (logits,) = run_step(model, cache, [StepItem(piece, start, pages, "all")])
            out.append(logits)
        return torch.cat(out)
    finally:
        cache.pages.release(pages)
