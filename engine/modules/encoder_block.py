"""The pre-norm transformer block of vision towers: no cache, attention within segments."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.modules.vision_attention import VisionAttention


class EncoderBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; with ``attn_out_norm`` and
    ``mlp_out_norm`` each sub-layer's output is normalised again before the add (Gemma 4's
    sandwich norms)."""

    def __init__(
        self,
        attn_norm: nn.Module,
        attention: VisionAttention,
        mlp_norm: nn.Module,
        mlp: nn.Module,
        attn_out_norm: nn.Module | None = None,
        mlp_out_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm, self.attention, self.mlp_norm, self.mlp = attn_norm, attention, mlp_norm, mlp
        self.attn_out_norm, self.mlp_out_norm = attn_out_norm, mlp_out_norm

    def forward(
        self,
        x: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        a = self.attention(self.attn_norm(x), segments, rotary)
        x = x + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))
