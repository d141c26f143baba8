"""One forward step over several sequences at once (the unit continuous batching schedules)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.paged import PagedKVCache
from engine.modules.batch import BatchLayout, SequenceSlice
from engine.modules.decoder import CausalLM
from engine.modules.splice import InputSplice
from engine.vision.media import PromptMedia


@dataclass
class StepItem:
    """Feed ``tokens`` to a sequence that already has ``past`` positions in the cache.

    ``logits``: ``"last"`` for the next-token distribution after the last token, ``"all"`` for
    one row per token (scoring), a number ``n`` for one row per token of the last ``n`` (a
    speculative verify step), ``None`` when the step only fills the cache (a prefill chunk).
    ``media``: the sequence's images (whole prompt), of which the step uses what it covers.
    ``state_slot``: the sequence's recurrent-state slot (``cache.state_slots``; None where the
    model keeps no recurrent state).
    """

    tokens: Sequence[int]
    past: int
    block_table: Sequence[int]
    logits: str | int | None = "last"
    media: PromptMedia | None = None
    state_slot: int | None = None


@torch.inference_mode()
def run_step(model: CausalLM, cache: PagedKVCache, items: Sequence[StepItem]) -> list[torch.Tensor | None]:
    """Each item's logit rows (None where it asks for none)."""
    return _run(model, cache, items, hidden=False)[0]


@torch.inference_mode()
def run_step_with_hidden(
    model: CausalLM, cache: PagedKVCache, items: Sequence[StepItem]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """:func:`run_step`, and each item's final hidden states ``[len(tokens), hidden]`` (after the
    final norm: what an MTP drafter reads, ``engine.generation.speculative.mtp``). Opt-in: the
    plain step computes the final norm only at its logit rows."""
    return _run(model, cache, items, hidden=True)


def _run(
    model: CausalLM, cache: PagedKVCache, items: Sequence[StepItem], hidden: bool
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    device = model.device
    ids, positions, write_slots, sequences, logit_rows = [], [], [], [], []
    spans: list[tuple[int, int] | None] = []
    splices: list[InputSplice] = []
    rope_positions: list[torch.Tensor] = []  # multimodal RoPE rows, when any item has them
    row = 0
    for item in items:
        if item.state_slot is None and cache.state_slots.count:
            raise ValueError("a model with recurrent layers needs each sequence's state slot")
        n = len(item.tokens)
        end = item.past + n
        slots = cache.slots(item.block_table, 0, end)
        ids.extend(item.tokens)
        positions.append(torch.arange(item.past, end))
        write_slots.append(slots[item.past :])
        media = item.media
        bidirectional = tuple(media.bidirectional_spans()) if media is not None else ()
        sequences.append(SequenceSlice(row, n, item.past, slots, bidirectional, item.state_slot))
        if media is not None:
            splices.append(media.splice(item.past, end, row))
            mrope = media.positions(item.past, end)
            if mrope is not None:
                rope_positions.append(mrope)
        if len(rope_positions) < len(sequences):  # plain positions, in M-RoPE's three rows
            rope_positions.append(positions[-1].expand(3, -1))
        first = len(logit_rows)
        if item.logits == "last":
            logit_rows.append(row + n - 1)
        elif item.logits == "all":
            logit_rows.extend(range(row, row + n))
        elif isinstance(item.logits, int):
            logit_rows.extend(range(row + n - item.logits, row + n))
        spans.append((first, len(logit_rows)) if item.logits else None)
        row += n
    has_mrope = any(item.media is not None and item.media.rope_positions is not None for item in items)
    batch = BatchLayout(
        sequences,
        torch.cat(positions).to(device),
        torch.cat(write_slots),
        torch.cat(rope_positions, dim=1).to(device) if has_mrope else None,
    )
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
    splice = InputSplice.merge(splices)
    if splice is not None:
        splice = splice.to(device)
    # Always run, even without logits: a prefill chunk fills the cache.
    if not hidden:
        logits = model(input_ids, batch, cache, rows, splice=splice)
        return [None if span is None else logits[span[0] : span[1]] for span in spans], []
    every = torch.arange(row, device=device)
    logits, states = model(input_ids, batch, cache, rows, splice=splice, hidden_rows=every)
    starts = [s.start for s in sequences]
    per_item = [states[start : start + len(item.tokens)] for start, item in zip(starts, items)]
    return [None if span is None else logits[span[0] : span[1]] for span in spans], per_item


def text_layout(items: Sequence[StepItem], cache: PagedKVCache, device: torch.device) -> BatchLayout:
    """The layout of a step over text-only ``items`` (no images, no recurrent state), for modules
    run outside a model's forward (an MTP drafter's layer over its own cache)."""
    positions, write_slots, sequences = [], [], []
    row = 0
    for item in items:
        n, end = len(item.tokens), item.past + len(item.tokens)
        slots = cache.slots(item.block_table, 0, end)
        positions.append(torch.arange(item.past, end))
        write_slots.append(slots[item.past :])
        sequences.append(SequenceSlice(row, n, item.past, slots))
        row += n
    return BatchLayout(sequences, torch.cat(positions).to(device), torch.cat(write_slots))


@torch.inference_mode()
def score_tokens(
    model: CausalLM,
    cache: PagedKVCache,
    token_ids: Sequence[int],
    chunk: int = 512,
    media: PromptMedia | None = None,
) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` for one sequence, prefilled in chunks.

    Uses (and afterwards releases) pages of ``cache``, and a recurrent-state slot where the model
    keeps one; the result does not depend on ``chunk``. ``media`` holds the images of a
    multimodal prompt (see ``engine.vision.prompt``).
    """
    pages = cache.pages.allocate(-(-len(token_ids) // cache.page_size))
    state = None
    try:
        state = cache.state_slots.allocate()
        out = []
        start = 0
        while start < len(token_ids):
            end = min(len(token_ids), start + chunk)
            if media is not None:
                end = media.chunk_end(start, end)
            item = StepItem(token_ids[start:end], start, pages, "all", media, state)
            (logits,) = run_step(model, cache, [item])
            out.append(logits)
            start = end
        return torch.cat(out)
    finally:
        cache.pages.release(pages)
        cache.state_slots.release(state)
