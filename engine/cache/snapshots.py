"""State snapshots: prefix reuse for models with recurrent layers.

Prefix reuse (``engine.cache.pages``) hands a new sequence the KV pages of a prompt prefix another
sequence computed. A recurrent layer keeps no such history: its state after the prefix was
overwritten as the other sequence went on. So the generator copies a sequence's state, in every
recurrent layer (every named tensor of ``RecurrentStateLayer.tensors``, one slot's row), into this
pool at chosen page boundaries: of its prompt (:func:`snapshot_positions`), and where a decode
step fills a page of its reply. That is the *snapshot* after the page that ends there, keyed by
that page's chained key. A new sequence whose prompt matches cached pages resumes at the last
matched page whose key has a snapshot (:meth:`SnapshotPool.resume_point`): it copies the snapshot
into its own slot and computes the rest of its prompt from there.

A pipelined decode step must be copied from before the next step advances the state, which is
before the host knows the step's input token and so the page's key: such a copy goes into a row
*held* under no key (:meth:`SnapshotPool.hold`), filed under the key once the token is read
(:meth:`SnapshotPool.file`) or given back if the sequence ends first (:meth:`SnapshotPool.drop`).

Invariants:

- A snapshot is the state after exactly the tokens its key names: it is taken after a step that
  ended on that page boundary and before the next step of the sequence, so it is complete or
  absent (a cancelled sequence leaves only the snapshots of boundaries it reached; a held row of
  a step whose tokens were never read is dropped).
- A snapshot lives no longer than a page of its key: the page allocator tells the pool each key
  it forgets (``PageAllocator.on_forget``), since without that page no prompt can match up to it.
- When the pool is full, saving (or holding) evicts the least recently used snapshot (saved or
  restored); held rows are not evicted.

Capacity comes from the cache's budget (``engine.cache_footprint.snapshot_capacity``: two per
sequence the cache runs at once, at most one per page, at most the KV pages' bytes) and counts in
the cache's ``nbytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from engine.cache.recurrent import RecurrentStateLayer


def snapshot_positions(prompt_len: int, start: int, page_size: int, every: int) -> list[int]:
    """Where a sequence computing its prompt from position ``start`` leaves a snapshot, ascending:
    every ``every`` pages, and at the end of the prompt's last full page; where the prompt ends on
    a page boundary, also at the end of the page before (a prompt's last token is always computed,
    so a repeat of the prompt can match only up to there). A prompt shorter than a page has none.
    """
    last = prompt_len // page_size * page_size
    ends = {last, (prompt_len - 1) // page_size * page_size}
    ends.update(range(every * page_size, last, every * page_size))
    return sorted(p for p in ends if p > start)


class SnapshotPool:
    """Up to ``capacity`` copies of one slot's state in every recurrent layer of a cache, keyed by
    page keys; storage is ``[capacity, *shape]`` for each tensor of each layer."""

    def __init__(self, layers: Sequence[RecurrentStateLayer], capacity: int) -> None:
        self.capacity = capacity
        self._layers = list(layers)
        self._store = [
            {
                name: torch.zeros(capacity, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
                for name, tensor in layer.tensors.items()
            }
            for layer in self._layers
        ]
        self._row_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._row_of

    def resume_point(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of ``keys`` (a prompt's matched pages) a sequence can skip: up to
        the last one whose key has a snapshot; 0 when none has."""
        for count in range(len(keys), 0, -1):
            if keys[count - 1] in self._row_of:
                return count
        return 0

    @property
    def held(self) -> int:
        """Rows held for a snapshot not yet filed under its key."""
        return self.capacity - len(self._row_of) - len(self._free)

    def save(self, key: bytes, slot: int) -> None:
        """Keep the state of state slot ``slot`` as the snapshot of ``key``. A key already kept
        holds the same state (the state after the same tokens): it is only marked as used."""
        if key in self._row_of:
            self._row_of.move_to_end(key)
            return
        row = self.hold(slot)
        if row is not None:
            self.file(row, key)

    def hold(self, slot: int) -> int | None:
        """Copy the state of state slot ``slot`` into a row kept under no key yet, for a snapshot
        whose key is not known when it must be taken; the row, to :meth:`file` or :meth:`drop`.
        None: no row to take (no capacity, or every row is held)."""
        if self._free:
            row = self._free.pop()
        elif self._row_of:
            _, row = self._row_of.popitem(last=False)
        else:
            return None
        for layer, store in zip(self._layers, self._store):
            for name, tensor in layer.tensors.items():
                store[name][row].copy_(tensor[slot])
        return row

    def file(self, row: int, key: bytes) -> None:
        """Keep held ``row`` as the snapshot of ``key``; where ``key`` is kept already (the same
        state) that one is marked as used and the row goes back."""
        if key in self._row_of:
            self._row_of.move_to_end(key)
            self._free.append(row)
        else:
            self._row_of[key] = row

    def drop(self, row: int) -> None:
        """Give back held ``row`` unfiled (its sequence ended before its key was known)."""
        self._free.append(row)

    def restore(self, key: bytes, slot: int) -> None:
        """Write the snapshot of ``key`` into state slot ``slot`` of every recurrent layer."""
        row = self._row_of[key]
        self._row_of.move_to_end(key)
        for layer, store in zip(self._layers, self._store):
            for name, tensor in layer.tensors.items():
                tensor[slot].copy_(store[name][row])

    def discard(self, key: bytes) -> None:
        """Drop the snapshot of ``key``, if kept (its page was evicted)."""
        row = self._row_of.pop(key, None)
        if row is not None:
            self._free.append(row)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in self._store for t in store.values())
