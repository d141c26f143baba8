"""What rank 0 sends the other ranks: the messages of the step protocol.

Rank 0 schedules (the Generator) and every step it runs becomes a :class:`StepPlan`: the step's
tokens, positions, cache slots, block tables and logit rows, plus the cache operations rank 0
made since the last step (snapshots of recurrent state). The other ranks rebuild the step's
``BatchLayout`` on their own device and run their shard of the forward over their own cache,
which has the same pages and slots as rank 0's (only the heads differ). Plans travel as pickled
objects of CPU tensors (``broadcast_object_list``); they are a few hundred bytes per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.modules.batch import BatchLayout, DecodeTables, SequenceSlice
from engine.modules.splice import InputSplice


@dataclass
class CacheSetup:
    """Make a cache like rank 0's cache ``cache_id`` (same pages, state slots and snapshots)."""

    cache_id: int
    num_pages: int
    page_size: int
    dtype: torch.dtype
    bits: tuple[int, int]
    max_sequences: int
    snapshots: int | None


@dataclass
class Stop:
    """The run is over: leave the loop and the process group."""


@dataclass
class GraphStep:
    """A decode step through the CUDA graph of shape ``(batch, pages)`` and head mode
    ``argmax_only`` over cache ``cache_id`` (:mod:`engine.parallel.graph_steps`): ``capture``
    warms it up and captures it (no replay), else it is replayed. The step's inputs reach the
    other ranks inside the step itself (broadcast from rank 0's device buffer), so the message
    names only the graph, after replaying ``cache_ops`` as :class:`StepPlan` does."""

    cache_id: int
    batch: int
    pages: int
    argmax_only: bool
    capture: bool
    cache_ops: list[tuple[str, tuple]] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int, bool]:
        return self.batch, self.pages, self.argmax_only


@dataclass
class DropGraphs:
    """Rank 0's capture failed: drop cache ``cache_id``'s graphs (its decode steps run eagerly)."""

    cache_id: int


@dataclass
class StepPlan:
    """One forward step: ``model(ids, layout, cache, logit_rows, splice)`` after replaying
    ``cache_ops`` (``(method, args)`` calls on the cache's snapshot pool, in rank 0's order).
    ``splice``: the step's image embeddings, which rank 0's vision tower computed. ``argmax_only``:
    the head reduces each row to its best id across ranks instead of gathering it whole."""

    cache_id: int
    ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    rope_positions: torch.Tensor | None
    sequences: list[SequenceSlice]
    decode: DecodeTables | None
    logit_rows: torch.Tensor | None
    splice: InputSplice | None = None
    cache_ops: list[tuple[str, tuple]] = field(default_factory=list)
    argmax_only: bool = False  # the step's logit rows are wanted only for their argmax

    @classmethod
    def capture(
        cls,
        cache_id: int,
        ids: torch.Tensor,
        batch: BatchLayout,
        logit_rows: torch.Tensor | None,
        splice: InputSplice | None,
        cache_ops: list[tuple[str, tuple]],
        argmax_only: bool = False,
    ) -> StepPlan:
        cpu = _to(torch.device("cpu"))
        decode = batch.decode
        if decode is not None:
            decode = replace(
                decode,
                block_tables=cpu(decode.block_tables),
                lengths=cpu(decode.lengths),
                state_slots=cpu(decode.state_slots),
            )
        return cls(
            cache_id,
            cpu(ids),
            cpu(batch.positions),
            cpu(batch.write_slots),
            cpu(batch.rope_positions),
            [replace(s, slots=cpu(s.slots)) for s in batch.sequences],
            decode,
            cpu(logit_rows),
            None if splice is None else splice.to("cpu"),
            cache_ops,
            argmax_only,
        )

    def inputs(
        self, device: torch.device
    ) -> tuple[torch.Tensor, BatchLayout, torch.Tensor | None, InputSplice | None]:
        """``(ids, layout, logit_rows, splice)`` on ``device``."""
        to = _to(device)
        decode = self.decode
        if decode is not None:
            decode = replace(
                decode,
                block_tables=to(decode.block_tables),
                lengths=to(decode.lengths),
                state_slots=to(decode.state_slots),
            )
        layout = BatchLayout(
            [replace(s, slots=to(s.slots)) for s in self.sequences],
            to(self.positions),
            to(self.write_slots),
            to(self.rope_positions),
            decode=decode,
        )
        splice = None if self.splice is None else self.splice.to(device)
        return to(self.ids), layout, to(self.logit_rows), splice


def _to(device: torch.device):
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return move
