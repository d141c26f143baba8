"""Going back in a running sequence: what a banned string's rewind does to its cache state.

The sequence keeps its first ``length`` tokens and will draw token ``length`` again, so the next
step must feed token ``length - 1`` and everything after the cached positions:

- KV pages: positions past the new end are simply no longer counted (``in_cache`` drops); the
  pages stay the sequence's (they are reserved up to its limit) and are written again. A page is
  named for prefix reuse only once it lies a rewind's reach behind the sequence's end (the
  generator's registration margin), so no named page ever changes content.
- Recurrent state: :class:`RewindPoints` keeps two checkpoints of it at least ``spacing`` tokens
  apart, so one always lies within a rewind's reach; the state is restored from it and the tokens
  after it are fed again (as one multi-token step). Before the reply's first checkpoint (the
  first reply token itself is rewound) the prompt is computed again, from its last state snapshot
  where one is kept.
"""

from __future__ import annotations

from engine.cache.paged import PagedKVCache
from engine.generation.state_checkpoint import StateCheckpoint, recurrent_layers


class RewindPoints:
    """Rolling checkpoints of one sequence's recurrent state: the newest two, taken at least
    ``spacing`` positions apart (a rewind goes back at most ``spacing`` tokens)."""

    def __init__(self, cache: PagedKVCache, spacing: int) -> None:
        self._layers = recurrent_layers(cache)
        self.spacing = spacing
        self.points: list[StateCheckpoint] = []

    @property
    def active(self) -> bool:
        """Whether the model has recurrent state to keep (else rewinds need no checkpoint)."""
        return bool(self._layers)

    def maybe_take(self, slot: int, position: int) -> None:
        """Before a step: checkpoint the state (after ``position`` tokens) when the newest
        checkpoint is ``spacing`` or more behind it; keep the newest two."""
        if not self._layers or slot is None:
            return
        if self.points and position - self.points[-1].position < self.spacing:
            return
        self.points = [*self.points[-1:], StateCheckpoint(self._layers, slot, position)]

    def restore(self, slot: int, position: int) -> int | None:
        """Restore the newest checkpoint at or before ``position`` into ``slot`` and return its
        position (later ones are dropped); None when there is none."""
        self.points = [p for p in self.points if p.position <= position]
        if not self.points:
            return None
        self.points[-1].restore(slot)
        return self.points[-1].position


def rewind_cache(cache: PagedKVCache, run, length: int, points: RewindPoints | None) -> None:
    """Make ``run``'s cached positions consistent with keeping its first ``length`` tokens:
    ``run.in_cache`` at most ``length - 1`` (token ``length - 1`` is fed again, its logits give
    the redrawn token), the recurrent state restored to match."""
    target = min(run.in_cache, length - 1)
    if points is None or not points.active:
        run.in_cache = target
        return
    kept = points.restore(run.state_slot, target)
    if kept is not None:
        run.in_cache = kept
        return
    # No checkpoint that early: compute the prompt again from its last kept snapshot (the prompt
    # then ends where the redrawn token is drawn). Only the first reply token can get here: the
    # reply's first checkpoint is taken at its first decode step, at the prompt's end.
    if length != run.prompt_len:
        raise RuntimeError(f"no state checkpoint at or before position {target} to rewind to")
    ps = cache.page_size
    keys = run.keys[: target // ps]
    resume = cache.snapshots.resume_point(keys) if cache.snapshots is not None else 0
    if resume:
        cache.snapshots.restore(keys[resume - 1], run.state_slot)
    run.in_cache = resume * ps
