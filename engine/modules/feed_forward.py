"""The plain two-layer feed-forward block of ViT-style towers and projectors: ``fc2(act(fc1(x)))``."""

from __future__ import annotations

import torch
from torch import nn

from engine.modules.mlp import ACTIVATIONS


class FeedForward(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation '{activation}'")
        self.fc1, self.fc2 = fc1, fc2
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
