"""Full (bidirectional) attention for vision towers, within segments of the token sequence.

A vision tower sees all of an image at once: there is no cache and no causal order. Tokens of
several images (or of several attention windows of one image, as in Qwen2.5-VL) are stacked in
one ``[N, hidden]`` tensor, and ``segments`` says which rows attend to each other; no row sees
outside its segment. Positions are optional rotary tables (2D RoPE), applied to q and k, over
the whole head or over each of ``rotary_parts`` equal parts of it on its own (Gemma 4: the first
half turns with the patch's column, the second with its row). Gemma 4 also RMS-normalises each
head's queries, keys and values (the values without a learned scale) and scales by 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.modules.linear import ProjectionGroup
from engine.modules.rope import rotate_half


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, d]`` by per-row tables ``[N, d]`` (rotate-half pairing within
    each of ``parts`` equal parts of the head), in fp32 as the towers' reference implementations
    do."""
    xf = x.float()
    turned = rotate_half(xf) if parts == 1 else torch.cat([rotate_half(p) for p in xf.chunk(parts, -1)], -1)
    return (xf * cos[:, None].float() + turned * sin[:, None].float()).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(
        self,
        qkv: ProjectionGroup,
        o_proj: nn.Module,
        num_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        norms: tuple[nn.Module, nn.Module, nn.Module] | None = None,
        rotary_parts: int = 1,
    ) -> None:
        """``scale``: the logits' (None: ``head_dim**-0.5``); ``norms``: per-head norms of the
        queries, keys and values, in that order."""
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_norm, self.k_norm, self.v_norm = norms if norms is not None else (None, None, None)
        self.rotary_parts = rotary_parts

    def forward(
        self,
        x: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        q, k, v = (t.reshape(-1, self.num_heads, self.head_dim) for t in self.qkv(x))
        if self.q_norm is not None:
            q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary, self.rotary_parts), apply_rotary(k, *rotary, self.rotary_parts)
        out = torch.empty_like(q)
        for start, end in segments:
            qh, kh, vh = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale).transpose(0, 1)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))
