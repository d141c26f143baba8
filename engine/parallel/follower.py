"""The loop of every rank but 0: wait for rank 0's next message and do what it says."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.paged import PagedKVCache
from engine.modules.decoder import CausalLM
from engine.parallel import messages
from engine.parallel.allreduce_cost import TimeAllReduces, replay_times
from engine.parallel.graph_steps import FollowerGraphs
from engine.parallel.snapshot_mirror import replay
from engine.parallel.step_plan import CacheSetup, DropGraphs, GraphStep, StepPlan, Stop
from engine.parallel.vocab import set_argmax_only


@torch.inference_mode()
def follow(module: CausalLM, states: Sequence, device: torch.device) -> int:
    """Run rank 0's steps on this rank's shard ``module`` until it says stop; ``states``: the
    per-layer states this rank's caches keep (``engine.parallel.sharding.local_states``).
    Returns the number of steps run (eager and from graphs; captures not counted)."""
    caches: dict[int, PagedKVCache] = {}
    graphs = FollowerGraphs(module, device)
    steps = 0
    while True:
        message = messages.receive()
        if isinstance(message, Stop):
            return steps
        if isinstance(message, CacheSetup):
            caches[message.cache_id] = PagedKVCache.for_layers(
                states,
                message.num_pages,
                message.page_size,
                message.dtype,
                device,
                message.bits,
                message.max_sequences,
                message.snapshots,
            )
        elif isinstance(message, StepPlan):
            cache = caches[message.cache_id]
            replay(cache.snapshots, message.cache_ops)
            ids, layout, rows, splice = message.inputs(device)
            set_argmax_only(module, message.argmax_only)
            module(ids, layout, cache, rows, splice=splice)
            steps += 1
        elif isinstance(message, GraphStep):
            cache = caches[message.cache_id]
            replay(cache.snapshots, message.cache_ops)
            graphs.run(cache, message)
            steps += 0 if message.capture else 1
        elif isinstance(message, DropGraphs):
            graphs.drop(message.cache_id)
        elif isinstance(message, TimeAllReduces):
            replay_times(message, device)
        else:
            raise TypeError(f"unknown message from rank 0: {type(message).__name__}")
