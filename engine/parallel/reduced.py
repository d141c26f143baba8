"""A sub-layer whose ranks each compute a part of its output: the parts are summed across ranks."""

from __future__ import annotations

import torch
from torch import nn

from engine.modules.linear import LinearSite
from engine.parallel.collectives import all_reduce_sum


class AllReduced(nn.Module):
    """``sum over ranks of inner(*args)``: wraps a row-parallel mixer or feed-forward (its last
    linear split by inputs, its bias on one rank only) so the block sees the whole output. One
    all-reduce per sub-layer, in the same order on every rank (every rank runs every block)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def dynamic_decode(self) -> str | None:
        return getattr(self.inner, "dynamic_decode", None)

    def quantizable_linears(self) -> list[LinearSite]:
        return self.inner.quantizable_linears()

    def forward(self, *args) -> torch.Tensor:
        return all_reduce_sum(self.inner(*args).contiguous())
