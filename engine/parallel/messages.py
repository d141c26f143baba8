"""Rank 0 -> all ranks messages: one broadcast of a small picklable object per step.

They travel on a process group of their own (gloo, on the CPU, whatever the compute backend is),
whose timeout is long: the other ranks wait there between steps for as long as rank 0 is idle,
while the collectives inside a step keep the run's short timeout.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

# How long the other ranks wait for rank 0's next message (an idle chat, a paused app).
IDLE_TIMEOUT = datetime.timedelta(days=7)

_group: dist.ProcessGroup | None = None


def open_channel() -> None:
    """Make the messages' group; every rank calls this once, right after joining the run."""
    global _group
    _group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def close_channel() -> None:
    global _group
    _group = None


def send(message: object) -> None:
    """Broadcast ``message`` from rank 0 (call on rank 0)."""
    dist.broadcast_object_list([message], src=0, group=_group)


def receive() -> object:
    """The next message rank 0 broadcasts (call on the other ranks)."""
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0, group=_group)
    return box[0]
