"""A mixture-of-experts router that scales its input before scoring (Gemma 4): the token is
RMS-normalised with no learned scale, multiplied by a learned per-feature scale and by
``hidden**-0.5``, then projected to one logit per expert."""

from __future__ import annotations

import torch
from torch import nn


class ScaledRouter(nn.Module):
    def __init__(self, norm: nn.Module, scale: torch.Tensor, proj: nn.Module) -> None:
        super().__init__()
        self.norm, self.proj = norm, proj
        self.scale = nn.Parameter(scale, requires_grad=False)  # [hidden]
        self.root = scale.shape[0] ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x) * self.scale * self.root)
