"""The collectives tensor parallelism uses, over the default ``torch.distributed`` group.

They are written once for every backend: gloo between CPU processes (tests, a CPU-only machine)
and NCCL between GPUs take the same calls on tensors of the rank's own device. Outside a process
group (or in a group of one) each is the identity, so a sharded module also runs alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, in place (every rank gets the sum)."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_to_leader(t: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``t`` (same shape on all), in rank order, on rank 0; None elsewhere."""
    if world_size() == 1:
        return [t]
    t = t.contiguous()
    if rank() == 0:
        parts = [torch.empty_like(t) for _ in range(world_size())]
        dist.gather(t, parts, dst=0)
        return parts
    dist.gather(t, None, dst=0)
    return None


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on all), in rank order, on every rank."""
    if world_size() == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts
