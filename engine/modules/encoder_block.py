"""The pre-norm transformer block of vision towers: no cache, attention within segments."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.modules.vision_attention import VisionAttention


class EncoderBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(
        self, attn_norm: nn.Module, attention: VisionAttention, mlp_norm: nn.Module, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.attn_norm, self.attention, self.mlp_norm, self.mlp = attn_norm, attention, mlp_norm, mlp

    def forward(
        self,
        x: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), segments, rotary)
        return x + self.mlp(self.mlp_norm(x))
