"""Decode steps of a tensor-parallel run through CUDA graphs, with the collectives captured.

Every rank captures and replays the same graphs in the same order, so the NCCL collectives
inside them (the row-parallel all-reduces, the vocabulary-parallel embedding's and head's) pair
up as they do in an eager step. Rank 0's ``DecodeGraphs`` (``engine.generation.cuda_graph``)
chooses the graph (batch bucket, page bucket, head mode) and, through :class:`LeaderGraphHooks`,
sends a :class:`~engine.parallel.step_plan.GraphStep` before each capture and each replay; the
other ranks' :class:`FollowerGraphs` capture or replay the graph it names. A step no graph takes
(a prefill, a batch past the largest bucket) is an eager :class:`StepPlan` on every rank alike.

The graph's step (:func:`shared_decode_forward`) starts with a broadcast of rank 0's input buffer
(:class:`~engine.generation.decode_inputs.DecodeInputs`): a pipelined step's token ids exist on
rank 0's device only, and this way they reach the other ranks device to device, inside the graph.
A rank that cannot capture (the CPU; a capture that failed) runs the same step eagerly: the same
collectives in the same order. Rank 0's failed capture drops every rank's graphs of that cache
(:class:`~engine.parallel.step_plan.DropGraphs`) and its steps run eagerly from then on.

The process group must exist, and each collective have run once eagerly, before a capture: the
group is made when the run starts, and every capture is preceded by warm-up steps (as in the
single-device recipe), which run the collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import kernels
from engine.cache.paged import PagedKVCache
from engine.generation.cuda_graph import WARMUP_STEPS, GraphHooks
from engine.generation.decode_inputs import DecodeInputs, decode_forward
from engine.modules.decoder import CausalLM
from engine.parallel.collectives import broadcast_from_leader
from engine.parallel.step_plan import GraphStep
from engine.parallel.vocab import set_argmax_only

if TYPE_CHECKING:
    from engine.parallel.leader import LeaderModule


def shared_decode_forward(
    module: CausalLM, cache: PagedKVCache, inputs: DecodeInputs, argmax_only: bool
) -> torch.Tensor:
    """A rank's decode step over rank 0's inputs (capture-safe): the input buffer is broadcast
    from rank 0 first, then this rank's shard runs; logits ``[batch, vocab]`` on rank 0 (argmax
    rows where ``argmax_only``), the rank's own slice elsewhere."""
    broadcast_from_leader(inputs.buffer)
    set_argmax_only(module, argmax_only)
    return decode_forward(module, cache, inputs)


class LeaderGraphHooks(GraphHooks):
    """Rank 0's side: its graphs run rank 0's shard, and each capture and replay is announced."""

    shared = True

    def __init__(self, leader: LeaderModule) -> None:
        self.leader = leader

    def variant(self) -> Hashable:
        # Argmax rows or whole gathered rows: the head's collectives differ, so does the graph.
        return self.leader.argmax_only

    def forward(self, model, cache: PagedKVCache, inputs: DecodeInputs, variant: Hashable) -> torch.Tensor:
        return shared_decode_forward(self.leader.inner, cache, inputs, bool(variant))

    def before_capture(self, cache: PagedKVCache, key: tuple) -> None:
        self.leader.announce_graph(cache, key, capture=True)

    def before_replay(self, cache: PagedKVCache, key: tuple) -> None:
        self.leader.announce_graph(cache, key, capture=False)

    def capture_failed(self, cache: PagedKVCache) -> None:
        self.leader.drop_graphs(cache)


@dataclass
class _Entry:
    inputs: DecodeInputs
    graph: torch.cuda.CUDAGraph | None = None  # None: run the step eagerly
    keepalive: tuple = ()


class FollowerGraphs:
    """The graphs of a rank other than 0, keyed as rank 0's: by cache, then (batch, pages, head
    mode). ``module``: the rank's shard."""

    def __init__(self, module: CausalLM, device: torch.device) -> None:
        self.module, self.device = module, device
        self._entries: dict[int, dict[tuple, _Entry]] = {}
        self._pool = None
        self.captures = 0  # graphs captured (statistics)
        self.replays = 0  # steps replayed from a graph

    def run(self, cache: PagedKVCache, message: GraphStep) -> None:
        """Capture or replay the graph ``message`` names, over ``cache`` (its cache ops replayed)."""
        entries = self._entries.setdefault(message.cache_id, {})
        entry = entries.get(message.key)
        if entry is None:
            inputs = DecodeInputs(message.batch, message.pages, cache.page_size, self.device)
            entry = entries[message.key] = _Entry(inputs)
        if message.capture:
            self._capture(cache, entry, message.argmax_only)
        elif entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        else:  # no graph here: the same step, and so the same collectives, eagerly
            shared_decode_forward(self.module, cache, entry.inputs, message.argmax_only)

    def drop(self, cache_id: int) -> None:
        self._entries.pop(cache_id, None)

    def _capture(self, cache: PagedKVCache, entry: _Entry, argmax_only: bool) -> None:
        """Warm up and capture as rank 0 does (its warm-up steps run the collectives with it)."""

        def step() -> torch.Tensor:
            return shared_decode_forward(self.module, cache, entry.inputs, argmax_only)

        if self.device.type != "cuda":
            for _ in range(WARMUP_STEPS):
                step()
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step()
        except Exception as exc:  # replays of this graph run eagerly instead
            print(
                f"trellis: tensor-parallel rank: CUDA graph capture failed ({type(exc).__name__}: {exc}); "
                "this rank runs those steps eagerly",
                file=sys.stderr,
            )
            return
        entry.graph = graph
        entry.keepalive = (*kernels.gemv.workspaces(), *kernels.moe.workspaces())
        self.captures += 1
