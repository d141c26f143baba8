"""Patch embedding: the first layer of a vision transformer (Dosovitskiy et al., 2020).

Checkpoints store it as a convolution whose stride equals its kernel (2D, or 3D where video
frames are grouped in time), which is the same map as a linear layer applied to each patch
flattened channel-major. We keep the linear form: patches are cut out once by the image
preprocessing, and a linear runs on any number of them without reshaping into a grid.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.modules.linear import DenseLinear


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[(H/p) * (W/p), C * p * p]``: patches in row-major order, each flattened
    channel-major (the layout a convolution kernel ``[out, C, p, p]`` reads)."""
    c, h, w = pixels.shape
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return grid.permute(1, 3, 0, 2, 4).reshape((h // patch) * (w // patch), c * patch * patch)


class PatchEmbedding(nn.Module):
    def __init__(self, conv_weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.proj = DenseLinear(conv_weight.reshape(conv_weight.shape[0], -1).contiguous(), bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[N, C * kernel volume]`` flattened patches -> ``[N, hidden]``."""
        return self.proj(patches.to(self.proj.weight.dtype))
