"""The plain two-layer feed-forward block, ``fc2(act(fc1(x)))``: ViT-style towers and projectors,
and the non-gated experts of a mixture (NemotronH's squared-ReLU experts: ``fc1`` is their
``up_proj``, ``fc2`` their ``down_proj``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.modules.linear import LinearSite
from engine.modules.mlp import ACTIVATIONS


class FeedForward(nn.Module):
    """``activation``: a name in ``ACTIVATIONS``, or a module for one with weights of its own
    (Apertus' xIELU, ``engine.modules.xielu``)."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module, activation: str | nn.Module) -> None:
        super().__init__()
        if isinstance(activation, str) and activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation '{activation}'")
        self.fc1, self.fc2 = fc1, fc2
        self.act = ACTIVATIONS[activation] if isinstance(activation, str) else activation

    def quantizable_linears(self) -> list[LinearSite]:
        return [LinearSite("up", self, "fc1"), LinearSite("down", self, "fc2")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
