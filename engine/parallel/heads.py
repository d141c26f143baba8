"""Which attention heads a rank computes: KV-head groups, replicated where they do not divide."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UsageError


@dataclass(frozen=True)
class HeadShard:
    """A rank's query heads (global indices, contiguous) and, for each of its local KV heads, the
    global KV head it holds; every local KV head serves the same number of query heads."""

    q_heads: list[int]
    kv_heads: list[int]


def replication(num_heads: int, num_kv_heads: int, world: int) -> int:
    """How many copies of each KV head the ranks hold between them: the smallest ``r`` with
    ``num_kv_heads * r`` divisible by ``world`` that still splits each head's query group evenly
    (1 where the KV heads divide across the ranks)."""
    if num_heads % num_kv_heads:
        raise UsageError(f"{num_heads} query heads do not form groups of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    for r in range(1, group + 1):
        if (num_kv_heads * r) % world == 0 and group % r == 0:
            return r
    raise UsageError(
        f"attention with {num_heads} query and {num_kv_heads} KV heads cannot be split across "
        f"{world} ranks (the query heads do not divide evenly)"
    )


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """Rank ``rank``'s heads: each KV head is copied :func:`replication` times, each copy serving
    an equal part of its query group, and the copies are split evenly across the ranks."""
    r = replication(num_heads, num_kv_heads, world)
    copies = num_kv_heads * r
    per_copy = num_heads // copies  # query heads each copy serves
    mine = range(rank * copies // world, (rank + 1) * copies // world)
    q_heads = [c * per_copy + i for c in mine for i in range(per_copy)]
    return HeadShard(q_heads, [c // r for c in mine])
