"""The collectives tensor parallelism uses, over the default ``torch.distributed`` group.

They are written once for every backend: gloo between CPU processes (tests, a CPU-only machine)
and NCCL between GPUs take the same calls on tensors of the rank's own device. Outside a process
group each is the identity, so a sharded module also runs alone. Inside one they are always
issued, even in a group of one (a test's run of one rank, whose collectives a CUDA graph
captures as it would with more ranks); NCCL ones may run inside a captured graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def in_group() -> bool:
    """Whether this process is in a process group (the collectives then run, even for one rank)."""
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, in place (every rank gets the sum)."""
    if in_group():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_from_leader(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` on every rank, in place (same shape and dtype on all)."""
    if in_group():
        dist.broadcast(t, src=0)
    return t


def gather_to_leader(t: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``t`` (same shape on all), in rank order, on rank 0; None elsewhere."""
    if not in_group():
        return [t]
    t = t.contiguous()
    if t.is_cuda:
        # NCCL's gather is point-to-point sends, which a CUDA graph does not reliably capture; an
        # all-gather is one collective (the other ranks receive rows they drop: a decode step's
        # few rows of a vocabulary slice each).
        parts = all_gather(t)
        return parts if rank() == 0 else None
    if rank() == 0:
        parts = [torch.empty_like(t) for _ in range(world_size())]
        dist.gather(t, parts, dst=0)
        return parts
    dist.gather(t, None, dst=0)
    return None


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on all), in rank order, on every rank."""
    if not in_group():
        return [t]
    t = t.contiguous()
    if t.is_cuda:  # into one tensor of ours: no copies out of a staging buffer (nor in a graph)
        stacked = t.new_empty((world_size(), *t.shape))
        dist.all_gather_into_tensor(stacked, t)
        return list(stacked.unbind(0))
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t)
    return parts
