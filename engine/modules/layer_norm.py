"""LayerNorm (Ba et al., 2016): the norm of ViT-style vision towers (SigLIP, Qwen3-VL)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """``(x - mean) / std * weight + bias`` over the last dimension."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
