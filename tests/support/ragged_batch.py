"""The ragged-batch check every recurrent family's tests run: several sequences share mixed steps
(their prompts split into chunks that cut them mid-way), then decode steps alternate between the
mixed path and the fixed-shape path (padded with a row on a scratch page and the scratch state
slot). Each sequence's logits must be those it gets alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.paged import PagedKVCache
from engine.generation.decode_inputs import run_decode_step
from engine.generation.step import StepItem, run_step, score_tokens


def alone_logits(model, tokens: list[int]) -> torch.Tensor:
    """The logits of ``tokens`` run by themselves in a fresh cache, in one step."""
    cache = PagedKVCache.for_model(model.spec, len(tokens) + 16, page_size=16, max_sequences=1)
    return score_tokens(model.module, cache, tokens, chunk=len(tokens) + 1)


def ragged_batch_logits(
    model,
    prompts: Sequence[list[int]],
    decode: Sequence[list[int]],
    chunk: int,
    slots: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Each sequence's logits (every prompt row, then one per decode token) when the sequences
    run together: prompts in chunks of ``chunk`` tokens, then decode steps, even ones in the
    mixed path and odd ones in the fixed-shape path with one padding row. ``slots``: the state
    slots the sequences take (default: as the allocator hands them out)."""
    n, page = len(prompts), 16
    longest = max(len(p) + len(d) for p, d in zip(prompts, decode))
    pages_each = -(-longest // page)
    cache = PagedKVCache.for_model(model.spec, (n * pages_each + 1) * page, page_size=page, max_sequences=n)
    if slots is None:
        slots = [cache.state_slots.allocate() for _ in prompts]
    tables = [cache.pages.allocate(pages_each) for _ in prompts]
    scratch_page = cache.pages.allocate(1)[0]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = [0] * n
    while any(d < len(p) for d, p in zip(done, prompts)):
        items, owners = [], []
        for i, prompt in enumerate(prompts):
            if done[i] < len(prompt):
                piece = prompt[done[i] : done[i] + chunk]
                items.append(StepItem(piece, done[i], tables[i], "all", state_slot=slots[i]))
                owners.append(i)
                done[i] += len(piece)
        for i, logits in zip(owners, run_step(model.module, cache, items)):
            got[i].append(logits)
    for step in range(len(decode[0])):
        items = [
            StepItem([decode[i][step]], len(prompts[i]) + step, tables[i], "last", state_slot=slots[i])
            for i in range(n)
        ]
        if step % 2 == 0:
            rows = run_step(model.module, cache, items)
        else:
            rows = run_decode_step(model.module, cache, items, batch=n + 1, scratch_page=scratch_page)
        for i, logits in enumerate(rows):
            got[i].append(logits)
    return [torch.cat(g) for g in got]
