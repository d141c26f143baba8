"""A decode step's inputs in fixed shapes: one buffer the host fills and copies in one go.

A decode step gives each sequence exactly one new token. :class:`DecodeInputs` holds, for a
fixed ``batch`` and ``max_pages``, everything such a step needs as one flat int64 tensor whose
tail holds int32 numbers (what the attention kernel reads; stored as such, so that the step
launches no conversion kernel for them):

    int64 [ ids (batch) | positions (batch) | write slots (batch) ]
    int32 [ lengths (batch) | tables (batch * max_pages) | state slots (batch) ]
          (padded to whole int64 entries)

The host writes it through a numpy view (cheap per element), rewrites a block-table row only
when that row's pages changed, and copies the whole buffer to the device with one transfer.
The device tensors the model reads are views of (or derived inside the step from) that one
device buffer, so their addresses never change: a CUDA graph captured over them replays with
whatever the host wrote last (``engine.generation.cuda_graph``).

Rows past the real batch are padding: one token each at the first positions of a scratch page,
which the caller has reserved from the cache's allocator, and the cache's scratch state slot, so
padding never writes a page or a recurrent state a sequence uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import kernels
from engine.cache.paged import PagedKVCache
from engine.generation.step import StepItem
from engine.modules.batch import BatchLayout, DecodeTables
from engine.modules.decoder import CausalLM


def is_decode_item(item: StepItem) -> bool:
    """One new token, next-token logits wanted, no images: what the fixed-shape path handles."""
    return len(item.tokens) == 1 and item.logits == "last" and item.media is None


def is_verify_item(item: StepItem) -> bool:
    """A speculative verify step's item: the last token and ``k`` drafted ones, a logit row for
    each, no images, no recurrent state (which would have to absorb the tokens one after another)."""
    n = len(item.tokens)
    return 1 < n and item.logits == n and item.media is None and item.state_slot is None


def decode_rows(items: Sequence[StepItem]) -> tuple[list[StepItem], list[tuple[int, int]]] | None:
    """The step as single-token decode rows, and each item's ``(first, end)`` rows; None when an
    item is neither a decode nor a verify item.

    A verify item of ``1 + k`` tokens becomes ``1 + k`` rows over the same block table, row ``j``
    at position ``past + j``. Each layer writes every row's key and value before any row attends,
    and row ``j`` attends up to its own position: the causal attention of the ``1 + k`` tokens,
    with the decode path's kernels and so inside its CUDA graphs.
    """
    rows, spans = [], []
    for item in items:
        if is_decode_item(item):
            spans.append((len(rows), len(rows) + 1))
            rows.append(item)
        elif is_verify_item(item):
            spans.append((len(rows), len(rows) + len(item.tokens)))
            rows.extend(
                StepItem([token], item.past + j, item.block_table) for j, token in enumerate(item.tokens)
            )
        else:
            return None
    return rows, spans


def pages_needed(items: Sequence[StepItem], page_size: int) -> int:
    """Block-table columns this step reads: the pages holding each sequence's positions so far."""
    return max(item.past // page_size + 1 for item in items)


class DecodeInputs:
    """Host staging and device buffer of one (``batch``, ``max_pages``) decode shape."""

    def __init__(self, batch: int, max_pages: int, page_size: int, device: torch.device) -> None:
        self.batch, self.max_pages, self.page_size = batch, max_pages, page_size
        self.device = torch.device(device)
        self._int32 = batch * (2 + max_pages)  # lengths, tables and state slots
        size = 3 * batch + (self._int32 + 1) // 2
        pin = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._np = self.host.numpy()
        self._np32 = self.host[3 * batch :].view(torch.int32).numpy()
        self.buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._rows: list[list[int] | None] = [None] * batch  # block-table row last written, per row
        # The host buffer may still be read by the last asynchronous copy: wait for it to finish
        # before writing again (in practice it has: sampling read the logits in between).
        self._copied = torch.cuda.Event() if pin else None

    def fill(self, items: Sequence[StepItem], scratch_page: int | None, scratch_state: int = 0) -> None:
        """Write ``items`` (``is_decode_item`` each, at most ``batch``) and copy them to the device.

        ``scratch_page`` takes the padding rows; it may be None only when there are none.
        ``scratch_state``: the state slot of padding rows, and of items without one (the cache's
        ``state_slots.scratch``; any slot where no layer keeps recurrent state).
        """
        b, p, ps, a, t = self.batch, self.max_pages, self.page_size, self._np, self._np32
        states = b * (1 + p)  # where the state slots start among the int32 numbers
        if len(items) < b and scratch_page is None:
            raise ValueError("padding rows need a scratch page")
        if self._copied is not None:
            self._copied.synchronize()
        for i, item in enumerate(items):
            pos = item.past
            table = item.block_table
            a[i] = item.tokens[0]
            a[b + i] = pos
            a[2 * b + i] = table[pos // ps] * ps + pos % ps
            t[i] = pos + 1
            t[states + i] = scratch_state if item.state_slot is None else item.state_slot
            row = list(table[:p])
            if self._rows[i] != row:
                start = b + i * p
                t[start : start + len(row)] = row
                t[start + len(row) : start + p] = row[0]  # any valid page: masked by the length
                self._rows[i] = row
        for i in range(len(items), b):
            # Each padding row its own slot of the scratch page (no two rows write one slot).
            pos = (i - len(items)) % ps
            a[i] = 0
            a[b + i] = pos
            a[2 * b + i] = scratch_page * ps + pos
            t[i] = pos + 1
            t[states + i] = scratch_state
            row = [scratch_page]
            if self._rows[i] != row:
                start = b + i * p
                t[start : start + p] = scratch_page
                self._rows[i] = row
        self.buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def views(self) -> tuple[torch.Tensor, BatchLayout]:
        """``(input_ids, layout)``: views of the device buffer, so they follow whatever was copied
        in last."""
        b, buf = self.batch, self.buffer
        ids, positions, slots = buf[:b], buf[b : 2 * b], buf[2 * b : 3 * b]
        decode = DecodeTables(self.tables(), self.lengths(), self.page_size, self.state_slots())
        return ids, BatchLayout([], positions, slots, decode=decode)

    def lengths(self) -> torch.Tensor:
        """The lengths as the device buffer holds them (int32, ``[batch]``)."""
        return self.buffer[3 * self.batch :].view(torch.int32)[: self.batch]

    def tables(self) -> torch.Tensor:
        """The block tables as the device buffer holds them (int32, ``[batch, max_pages]``)."""
        b = self.batch
        return self.buffer[3 * b :].view(torch.int32)[b : b * (1 + self.max_pages)].view(b, self.max_pages)

    def state_slots(self) -> torch.Tensor:
        """The recurrent-state slots as the device buffer holds them (int32, ``[batch]``)."""
        b = self.batch
        return self.buffer[3 * b :].view(torch.int32)[b * (1 + self.max_pages) : self._int32]


def decode_forward(model: CausalLM, cache: PagedKVCache, inputs: DecodeInputs) -> torch.Tensor:
    """Logits ``[batch, vocab]`` (float32) of the step in ``inputs``' device buffer; capture-safe."""
    ids, layout = inputs.views()
    # A loaded model's decode step writes no weight, so its kernels may launch chained.
    with kernels.chained_launches(model.device):
        return model(ids, layout, cache, None)


@torch.inference_mode()
def run_decode_step(
    model: CausalLM,
    cache: PagedKVCache,
    items: Sequence[StepItem],
    max_pages: int | None = None,
    batch: int | None = None,
    scratch_page: int | None = None,
) -> list[torch.Tensor]:
    """``run_step(model, cache, items)`` for decode and verify ``items``, through the fixed-shape
    path without a graph (any device). ``batch`` (rows, at least one per decode item and
    ``1 + k`` per verify item) adds padding rows on ``scratch_page``; ``max_pages`` (default: just
    enough) pads the block tables."""
    expanded = decode_rows(items)
    if expanded is None:
        raise ValueError("the fixed-shape decode path takes decode and verify items only")
    rows, spans = expanded
    pages = max_pages or pages_needed(rows, cache.page_size)
    inputs = DecodeInputs(batch or len(rows), pages, cache.page_size, model.device)
    inputs.fill(rows, scratch_page, cache.state_slots.scratch)
    logits = decode_forward(model, cache, inputs)
    return [logits[first:end] for first, end in spans]
