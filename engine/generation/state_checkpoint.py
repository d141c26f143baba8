"""A copy of one sequence's recurrent state, to go back to.

A model with recurrent layers (gated delta nets, Mamba-2, short convolutions) keeps one state per
sequence that each step overwrites; unlike KV pages, positions cannot be dropped from it. Going
back (rejected draft tokens, a banned string's rewind) therefore means restoring a copy taken
earlier and feeding the tokens after it again. A :class:`StateCheckpoint` is such a copy: every
named tensor of every recurrent layer, one slot's row, with the position it stands for.
"""

from __future__ import annotations

import torch

from engine.cache.paged import PagedKVCache
from engine.cache.recurrent import RecurrentStateLayer


def recurrent_layers(cache: PagedKVCache) -> list[RecurrentStateLayer]:
    """The cache's recurrent-state layers, in layer order (none for an attention-only model)."""
    if cache.state_slots.count == 0:
        return []
    layers, index = [], 0
    while True:
        try:
            layer = cache.layer(index)
        except IndexError:
            return layers
        if isinstance(layer, RecurrentStateLayer):
            layers.append(layer)
        index += 1


class StateCheckpoint:
    """The state of slot ``slot`` after ``position`` tokens, copied out of ``layers``."""

    def __init__(self, layers: list[RecurrentStateLayer], slot: int, position: int) -> None:
        self.position = position
        self._copies: list[dict[str, torch.Tensor]] = [
            {name: tensor[slot].clone() for name, tensor in layer.tensors.items()} for layer in layers
        ]
        self._layers = layers

    def restore(self, slot: int) -> None:
        """Write the copy back into ``slot`` of every recurrent layer."""
        for layer, copies in zip(self._layers, self._copies):
            for name, tensor in layer.tensors.items():
                tensor[slot].copy_(copies[name])
