"""Rank 0's snapshot pool, recording the calls that change it so that the other ranks repeat them.

The pool's bookkeeping (which row holds which key) is deterministic: the same calls in the same
order give every rank the same rows, so each rank's own copy of the recurrent state (replicated
layers keep it whole on every rank) is saved and restored alike.
"""

from __future__ import annotations

from engine.cache.snapshots import SnapshotPool

CHANGING = frozenset({"save", "hold", "file", "drop", "restore", "discard"})


class RecordedSnapshots:
    """Stands in for ``pool``: every attribute is the pool's; the changing calls are logged too."""

    def __init__(self, pool: SnapshotPool) -> None:
        self._pool = pool
        self.log: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        attr = getattr(self._pool, name)
        if name not in CHANGING:
            return attr

        def recorded(*args):
            self.log.append((name, args))
            return attr(*args)

        return recorded

    def __len__(self) -> int:
        return len(self._pool)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pool

    def drain(self) -> list[tuple[str, tuple]]:
        """The calls logged since the last drain, oldest first."""
        log, self.log = self.log, []
        return log


def replay(pool: SnapshotPool | None, calls: list[tuple[str, tuple]]) -> None:
    """Repeat rank 0's ``calls`` on this rank's ``pool``."""
    for name, args in calls:
        if name not in CHANGING:
            raise ValueError(f"not a snapshot pool change: {name}")
        getattr(pool, name)(*args)
