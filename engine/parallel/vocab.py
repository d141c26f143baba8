"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

The embedding looks up the ids in its slice (zeros for the others) and the ranks' rows are
summed. The head computes its slice's logits; rank 0 gathers the slices when the caller needs
the whole row, while :func:`parallel_argmax` and :func:`parallel_top_k` reduce across ranks and
move only ``k`` numbers per row (a step of plain greedy rows: ``VocabParallelHead.argmax_only``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.modules.int8 import Int8Embedding
from engine.parallel.collectives import all_gather, all_reduce_sum, gather_to_leader
from engine.parallel.collectives import rank as this_rank
from engine.parallel.slicing import SliceNotes, take_outputs


def vocab_slice(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s ids: equal slices of ``ceil(vocab / world)`` (the last
    one short), so that every rank's logits have one shape and gather without padding logic."""
    per = -(-vocab // world)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of ids ``start .. start + rows - 1`` of a ``vocab``-id table
    (``table``: an ``nn.Embedding`` or an int8 one of just those rows); the rank sum gives every
    id's row."""

    def __init__(self, table: nn.Module, start: int, vocab: int) -> None:
        super().__init__()
        self.table, self.start, self.vocab = table, start, vocab  # vocab: every rank's ids

    @property
    def weight(self) -> torch.Tensor:  # CausalLM reads the dtype and device here
        return self.table.weight

    @property
    def dtype(self) -> torch.dtype:  # an int8 table's rows come out in this dtype
        return getattr(self.table, "dtype", self.table.weight.dtype)

    @classmethod
    def from_embedding(cls, embedding: nn.Module, rank: int, world: int) -> VocabParallelEmbedding:
        start, end = vocab_slice(embedding.weight.shape[0], rank, world)
        if isinstance(embedding, Int8Embedding):
            scale = embedding.scale.data[start:end]
            table = Int8Embedding(embedding.weight.data[start:end], scale, embedding.dtype)
        else:
            table = nn.Embedding.from_pretrained(embedding.weight.data[start:end].clone(), freeze=True)
        return cls(table, start, embedding.weight.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= rows)
        found = self.table(local.clamp(0, max(0, rows - 1)))
        return all_reduce_sum(found.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """The LM head's logits for ids ``start .. end - 1`` on each rank; :meth:`forward` returns the
    whole vocabulary on rank 0 (gathered) and the rank's own slice elsewhere."""

    def __init__(self, linear: nn.Module, vocab: int, start: int, per_rank: int) -> None:
        super().__init__()
        self.linear, self.vocab, self.start, self.per_rank = linear, vocab, start, per_rank
        self.argmax_only = False  # see forward

    @classmethod
    def from_linear(
        cls, linear: nn.Module, vocab: int, rank: int, world: int, notes: SliceNotes
    ) -> VocabParallelHead:
        start, end = vocab_slice(vocab, rank, world)
        local = take_outputs(linear, torch.arange(start, end), notes)
        return cls(local, vocab, start, -(-vocab // world))

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice ``[rows, per_rank]``, padded with ``-inf`` past the vocabulary."""
        y = self.linear(x)
        short = self.per_rank - y.shape[-1]
        return F.pad(y, (0, short), value=float("-inf")) if short else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(x)
        if self.argmax_only:
            return self._argmax_rows(local)
        parts = gather_to_leader(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., : self.vocab]

    def _argmax_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Rows whose argmax is the whole row's (ties: the lowest id), from each row's best
        ``(value, id)`` across ranks (:func:`parallel_top_k`): the row's maximum at that id and
        ``-inf`` elsewhere. Made on rank 0 from ``2 * world`` numbers per row; the other ranks
        return their slice."""
        flat = local.reshape(-1, local.shape[-1])
        values, ids = parallel_top_k(flat, self.start, 1)
        if this_rank() != 0:
            return local
        rows = flat.new_full((flat.shape[0], self.vocab), float("-inf"))
        rows.scatter_(1, ids, values.to(rows.dtype))
        return rows.reshape(*local.shape[:-1], self.vocab)


def set_argmax_only(module: nn.Module, argmax_only: bool) -> None:
    """Make ``module``'s vocabulary-parallel head (if it has one) return argmax rows
    (:meth:`VocabParallelHead._argmax_rows`) or whole rows in the steps that follow."""
    head = getattr(module, "lm_head", None)
    if isinstance(head, VocabParallelHead):
        head.argmax_only = argmax_only


def parallel_argmax(local: torch.Tensor, start: int) -> torch.Tensor:
    """Each row's argmax over the whole vocabulary, on every rank, from each rank's ``local``
    logits ``[rows, n]`` of ids ``start ..``: ties go to the lowest id, as ``torch.argmax``."""
    return parallel_top_k(local, start, 1)[1][:, 0]


def parallel_top_k(local: torch.Tensor, start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` ``[rows, k]`` of the whole vocabulary's top ``k``, on every rank: each
    rank offers its own top ``k``, and the best ``k`` of those are the best of all. Equal values
    are ordered by id (lowest first)."""
    k_local = min(k, local.shape[-1])
    values, ids = local.float().topk(k_local, dim=-1, sorted=True)
    ids = ids + start
    all_values = torch.cat(all_gather(values), dim=-1)
    all_ids = torch.cat(all_gather(ids), dim=-1)
    # Sort by id first, then stably by value: equal values keep the lowest id first.
    by_id = all_ids.argsort(dim=-1)
    all_values, all_ids = all_values.gather(-1, by_id), all_ids.gather(-1, by_id)
    order = all_values.argsort(dim=-1, descending=True, stable=True)[:, :k]
    return all_values.gather(-1, order), all_ids.gather(-1, order)
