"""Loading a tensor-parallel rank's shard without reading the whole model.

:class:`ShardBuilder` is the model builder of a rank: it builds every linear as a
:class:`~engine.parallel.stored_linear.StoredLinear` (nothing read yet) and the embedding as the
rank's vocabulary slice read alone from the file (a tied head shares those rows).
:func:`engine.parallel.sharding.shard_model` then takes each split linear's part, which reads
just that part, and :func:`~engine.parallel.stored_linear.load_stored` reads the linears no split
took a part of. What a rank holds in memory while it loads is its shard
plus the one linear being read; norms, convolutions and other small tensors are read whole.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from engine.loading.builder import ModelBuilder
from engine.modules.int8 import Int8Embedding
from engine.modules.linear import DenseLinear
from engine.parallel.stored_linear import StoredLinear
from engine.parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_slice


class ShardBuilder(ModelBuilder):
    """The builder of rank ``rank`` of ``world`` (``world`` > 1): linears left unread until the
    split asks for their parts, the embedding cut to the rank's vocabulary slice. A store
    without :meth:`~engine.loading.safetensors_store.WeightStore.get_part` (random weights)
    is read whole and cut."""

    def __init__(self, *args, rank: int, world: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank, self.world = rank, world

    def linear(self, key: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        read_whole = partial(ModelBuilder.linear, self, key, in_features, out_features, bias)
        return StoredLinear(self, read_whole, key, in_features, out_features, f"{key}.bias" if bias else None)

    def embedding(self) -> nn.Module:
        s, n = self.spec, self.names
        if not hasattr(self.store, "get_part"):
            return VocabParallelEmbedding.from_embedding(super().embedding(), self.rank, self.world)
        key = n.prefix + n.embed + ".weight"
        if list(self.store.shape(key)) != [s.vocab_size, s.hidden_size]:
            return VocabParallelEmbedding.from_embedding(super().embedding(), self.rank, self.world)
        start, end = vocab_slice(s.vocab_size, self.rank, self.world)
        if self.keeps_int8(key):
            table: nn.Module = Int8Embedding(*self.store.int8_part(key, 0, start, end), self.dtype)
        else:
            rows = self.store.get_part(key, 0, start, end, dtype=self.dtype, device=self.device)
            table = nn.Embedding.from_pretrained(rows, freeze=True)
        return VocabParallelEmbedding(table, start, s.vocab_size)

    def tied_head(self, embedding: nn.Module, bias: torch.Tensor | None) -> nn.Module:
        """The head over the rank's slice of the embedding table itself (read once, shared)."""
        if not isinstance(embedding, VocabParallelEmbedding):
            return super().tied_head(embedding, bias)
        vocab, start = embedding.vocab, embedding.start
        end = start + embedding.weight.shape[0]
        local_bias = None if bias is None else bias[start:end]
        table = embedding.table
        head = (
            table.head(local_bias)
            if isinstance(table, Int8Embedding)
            else DenseLinear(table.weight, local_bias)
        )
        return VocabParallelHead(head, vocab, start, -(-vocab // self.world))
