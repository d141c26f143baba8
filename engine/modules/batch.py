"""The layout of one forward step over a flat batch of several sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceSlice:
    """One sequence's part of a step.

    ``rows`` are its new tokens' rows in the flat batch; ``past`` tokens of it are already in the
    cache; ``slots`` maps every position ``0 .. past + length - 1`` to a slot of the paged cache.
    ``state_slot``: its slot in the recurrent layers' state (None where no layer keeps any).
    """

    start: int
    length: int
    past: int
    slots: torch.Tensor
    # Position ranges [lo, hi) whose tokens attend to each other in both directions (one image's
    # tokens in Gemma 3); a step never ends inside one.
    bidirectional: tuple[tuple[int, int], ...] = ()
    state_slot: int | None = None

    @property
    def end_position(self) -> int:
        return self.past + self.length

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)

    def state_before(self, states: torch.Tensor) -> torch.Tensor:
        """This sequence's recurrent state before the step, from ``states`` ``[slots + 1, ...]``:
        zeros where it starts here (a slot keeps what its previous sequence left)."""
        return states[self.state_slot] if self.past > 0 else states.new_zeros(states.shape[1:])


@dataclass
class DecodeTables:
    """A decode step in fixed shapes: row ``b`` is the one new token of sequence ``b``.

    ``block_tables`` ``[batch, max_pages]`` int32 lists each sequence's pages (padded with any
    valid page), ``lengths`` ``[batch]`` int32 counts its cached positions including the new one,
    ``state_slots`` ``[batch]`` int32 gives its recurrent-state slot (padding rows: the scratch
    slot). They live on the model's device, so mixers need no per-sequence host work and the step
    can be captured in a CUDA graph (``engine.generation.cuda_graph``).
    """

    block_tables: torch.Tensor
    lengths: torch.Tensor
    page_size: int
    state_slots: torch.Tensor | None = None


@dataclass
class BatchLayout:
    sequences: list[SequenceSlice]
    positions: torch.Tensor  # [tokens] absolute position of every row
    write_slots: torch.Tensor  # [tokens] cache slot each row's key/value goes to
    rope_positions: torch.Tensor | None = None  # [3, tokens] multimodal RoPE positions (Qwen-VL)
    # Set when every row is a single-token decode: mixers then run on these tables at once
    # instead of looping over ``sequences`` (which may then be empty).
    decode: DecodeTables | None = None
    _rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _key_positions: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def rope_tables(self, rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, computed once per rotary module and shared by layers."""
        key = id(rope)
        if key not in self._rope_tables:
            multimodal = self.rope_positions is not None and getattr(rope, "multimodal", False)
            self._rope_tables[key] = rope.tables(self.rope_positions if multimodal else self.positions, dtype)
        return self._rope_tables[key]

    def key_positions(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """``arange(start, end)`` on ``device``: the positions of the cached keys a sequence's
        queries read, made once per step and shared by all layers (not one kernel per layer)."""
        key = (start, end, torch.device(device))
        if key not in self._key_positions:
            self._key_positions[key] = torch.arange(start, end, device=device)
        return self._key_positions[key]


def decode_states_before(states: torch.Tensor, batch: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-shape decode step's state slots (int64, for indexing) and each row's recurrent state
    before the step, from ``states`` ``[slots + 1, ...]``: zeros where a row starts its sequence
    (position 0), with no host work, so the step can be captured in a CUDA graph."""
    slots = batch.decode.state_slots.long()
    fresh = (batch.positions == 0).view(-1, *[1] * (states.dim() - 1))
    return slots, torch.where(fresh, torch.zeros((), dtype=states.dtype, device=states.device), states[slots])
