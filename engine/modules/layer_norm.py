"""LayerNorm (Ba et al., 2016): the norm of ViT-style vision towers (SigLIP, Qwen3-VL) and of
Cohere's decoders (a scale and no bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """``(x - mean) / std * weight + bias`` over the last dimension.

    A ``weight`` of more than one dimension gives each of the rows it covers a scale of its own
    (``[heads, head_dim]``: Cohere's per-head q/k norms over ``[..., heads, head_dim]``), each row
    still normalised over the last dimension alone.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, key: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.eps = eps
        self.key = key  # the checkpoint key it was read from ("" for one made otherwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 1:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        y = F.layer_norm(x, x.shape[-1:], None, None, self.eps) * self.weight
        return y if self.bias is None else y + self.bias
