"""What a row-parallel all-reduce costs at batch 1 inside a captured CUDA graph (``bench --tp N
--allreduce-cost``).

Every rank captures two graphs over one ``[1, hidden]`` row: one that only clears the row, and
one that clears it and then sums it across the ranks ``count`` times (one all-reduce per layer
of the model: its depth, at its width and dtype). Both are replayed many times in rounds; the
difference of their median replay times over ``count`` is one all-reduce as a decode step's
graph runs it, launch included. A decode step runs two per layer (attention, feed-forward) and
one for the embedding. On the CPU (gloo) nothing is captured: the same loops run eagerly.

Rank 0 asks the other ranks with a :class:`TimeAllReduces` message (they run
:func:`replay_times` alongside it, so that their collectives pair up).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.parallel.collectives import all_reduce_sum
from engine.parallel.leader import LeaderModule

ROUNDS = 5
REPLAYS = 200


@dataclass
class TimeAllReduces:
    """Every rank: run :func:`replay_times` with these arguments."""

    count: int
    width: int
    dtype: torch.dtype
    replays: int = REPLAYS
    rounds: int = ROUNDS


def replay_times(message: TimeAllReduces, device: torch.device) -> tuple[float, float]:
    """Median ms per replay of ``(the graph without all-reduces, the graph with them)``."""
    row = torch.zeros(1, message.width, dtype=message.dtype, device=device)

    def base() -> None:
        row.zero_()

    def summed() -> None:
        row.zero_()
        for _ in range(message.count):
            all_reduce_sum(row)

    for _ in range(2):  # the communicator exists, and each collective ran once, before a capture
        summed()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        runs = [_captured(base, device), _captured(summed, device)]
    else:
        runs = [base, summed]
    return tuple(_median_ms(run, message, device) for run in runs)


def _captured(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture's stream
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph.replay


def _median_ms(run: Callable[[], None], message: TimeAllReduces, device: torch.device) -> float:
    run()  # every rank has replayed once: they start the rounds together
    times = []
    for _ in range(message.rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(message.replays):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / message.replays)
        else:
            t = time.perf_counter()
            for _ in range(message.replays):
                run()
            times.append((time.perf_counter() - t) * 1e3 / message.replays)
    return sorted(times)[len(times) // 2]


def all_reduce_cost(model, replays: int = REPLAYS, rounds: int = ROUNDS) -> dict:
    """Rank 0 of a tensor-parallel ``model`` (a :class:`~engine.model.LoadedModel` whose module is
    the :class:`~engine.parallel.leader.LeaderModule`): the figures, in microseconds."""
    leader = model.module
    if not isinstance(leader, LeaderModule):
        raise ValueError("the all-reduce cost needs a tensor-parallel model (--tp N)")
    layers = len(leader.blocks)
    message = TimeAllReduces(layers, model.spec.hidden_size, model.dtype, replays, rounds)
    leader.tell(message)
    with torch.inference_mode():
        base_ms, summed_ms = replay_times(message, model.device)
    each_us = max(0.0, summed_ms - base_ms) * 1e3 / layers
    return {
        "in_graph": model.device.type == "cuda",
        "width": message.width,
        "all_reduces_in_graph": layers,
        "graph_us": summed_ms * 1e3,
        "empty_graph_us": base_ms * 1e3,
        "per_all_reduce_us": each_us,
        "per_layer_us": 2 * each_us,  # attention and feed-forward
        "per_step_us": (2 * layers + 1) * each_us,  # and the embedding's
    }


def describe(cost: dict, world: int) -> str:
    """One line for the bench's table."""
    where = "inside a CUDA graph" if cost["in_graph"] else "eager (CPU)"
    return (
        f"all-reduce over {world} ranks of 1 x {cost['width']} {where}: "
        f"{cost['per_all_reduce_us']:.1f} us each, {cost['per_layer_us']:.1f} us per layer (2), "
        f"{cost['per_step_us']:.1f} us per decode step "
        f"(graph of {cost['all_reduces_in_graph']}: {cost['graph_us']:.1f} us, "
        f"without them: {cost['empty_graph_us']:.1f} us)"
    )
