"""A linear layer whose input and output are clamped to stored bounds (Gemma 4's "clippable"
linears in its towers, where ``use_clipped_linears``: the bounds keep activations in the range
the model was trained to see)."""

from __future__ import annotations

import torch
from torch import nn


class ClippedLinear(nn.Module):
    def __init__(self, linear: nn.Module, input_bounds: torch.Tensor, output_bounds: torch.Tensor) -> None:
        """``*_bounds``: ``[2]`` (minimum, maximum); infinite where unbounded."""
        super().__init__()
        self.linear = linear
        self.register_buffer("input_bounds", input_bounds)
        self.register_buffer("output_bounds", output_bounds)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.clamp(x, self.input_bounds[0], self.input_bounds[1])
        return torch.clamp(self.linear(x), self.output_bounds[0], self.output_bounds[1])
