"""LFM2's gated short convolution (Liquid AI, 2025), a mixer that looks only at the last few
tokens, in the line of the gated convolutions of H3 and Hyena (Fu et al., 2023; Poli et al., 2023):

    B, C, x = in_proj(h)          three [tokens, hidden] parts, in that order
    y = out_proj(C * conv(B * x))

``conv`` is a depthwise causal convolution over the last ``L`` positions (``conv_L_cache``, 3 in
LFM2). So the only thing a sequence carries from one step to the next is the convolution's window:
the last ``L - 1`` values of ``B * x``, kept in the layer's recurrent state (``"conv"``,
``[hidden, L - 1]`` per slot, :mod:`engine.modules.causal_conv`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.recurrent import RecurrentStateLayer
from engine.modules.batch import BatchLayout
from engine.modules.causal_conv import CausalConv1d
from engine.modules.linear import LinearSite


class ShortConv(nn.Module):
    """``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)``; ``conv`` keeps its window
    in the state tensor ``"conv"`` of the layer's cache."""

    def __init__(self, in_proj: nn.Module, conv: CausalConv1d, out_proj: nn.Module) -> None:
        super().__init__()
        # Registered in the order they run: the converter writes a layer's tensors in this order.
        self.in_proj, self.conv, self.out_proj = in_proj, conv, out_proj

    def quantizable_linears(self) -> list[LinearSite]:
        """The two projections; the convolution's few weights per channel stay as stored."""
        return [LinearSite("in", self, "in_proj"), LinearSite("out", self, "out_proj")]

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache: RecurrentStateLayer) -> torch.Tensor:
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(c * self.conv(b * v, batch, cache["conv"]))
