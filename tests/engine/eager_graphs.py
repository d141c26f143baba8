"""CUDA graphs on the CPU, for tests: a stand-in capture whose "graph" runs the captured step's
fixed-shape forward eagerly on each replay, so :class:`~engine.generation.cuda_graph.DecodeGraphs`
(buckets, padding rows, scratch pages and slots, verify rows) runs as it does on a GPU."""

from __future__ import annotations

import torch

from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.decode_inputs import decode_forward


class EagerGraph:
    """Replays ``entry``'s step by running it: the same inputs buffer, the same output tensor."""

    def __init__(self, runner: DecodeGraphs, entry) -> None:
        self.args, self.out = (runner.model, runner.cache, entry.inputs), entry.logits

    def replay(self) -> None:
        self.out.copy_(decode_forward(*self.args))


def eager_capture(self: DecodeGraphs, entry) -> bool:
    entry.logits = torch.empty(entry.inputs.batch, self.model.lm_head.weight.shape[0])
    entry.graph = EagerGraph(self, entry)
    return True


def use_eager_graphs(monkeypatch) -> None:
    """Every DecodeGraphs of the test captures with :func:`eager_capture`."""
    monkeypatch.setattr(DecodeGraphs, "_capture", eager_capture)
