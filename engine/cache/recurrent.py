"""Recurrent state in slots: one fixed-size state per running sequence, for every layer that
declares a :class:`~engine.cache.state.RecurrentState`.

A sequence takes a slot when it starts (:meth:`StateSlots.allocate`) and gives it back when it
finishes; the same slot index addresses its state in every recurrent layer. Storage has one row
more than there are slots: the padding rows of a fixed-shape decode step
(``engine.generation.decode_inputs``) read and write that last row, so they never touch a
sequence's state.
"""

from __future__ import annotations

import heapq

import torch

from engine.cache.state import RecurrentState
from engine.errors import ContextOverflowError


class RecurrentStateLayer:
    """One layer's recurrent state: for each named tensor, ``[slots + 1, *shape]``."""

    def __init__(self, state: RecurrentState, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tensors = {
            name: torch.zeros(slots + 1, *shape, dtype=state.dtype or dtype, device=device)
            for name, shape in state.shapes.items()
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class StateSlots:
    """Which state slots are taken. A cache without recurrent layers has ``count`` 0: each
    sequence then gets None, and slots never run out."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))  # a min-heap: the lowest free slot first

    @property
    def scratch(self) -> int:
        """The row padding rows use (past the last slot)."""
        return self.count

    @property
    def exhausted(self) -> bool:
        """Whether a sequence that needs a slot has to wait for one."""
        return self.count > 0 and not self._free

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None where no layer keeps recurrent state."""
        if self.count == 0:
            return None
        if not self._free:
            raise ContextOverflowError(f"all {self.count} recurrent-state slots are taken")
        return heapq.heappop(self._free)

    def release(self, slot: int | None) -> None:
        if slot is not None:
            heapq.heappush(self._free, slot)
