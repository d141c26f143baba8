"""Gemma 4's vision tower: patches of any grid (the image keeps its aspect ratio), each embedded
with a learned table per axis (column and row), transformer blocks with sandwich RMSNorms, q/k/v
norms and a 2D RoPE that turns the first half of each head with the column and the second with
the row, then each ``k x k`` square of patches averaged into one soft token, scaled by
``sqrt(hidden)`` (and standardised where the checkpoint says so), RMS-normalised without a scale
and projected into the language model."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.modules.clipped_linear import ClippedLinear
from engine.modules.encoder_block import EncoderBlock
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.norms import RMSNorm
from engine.modules.vision_attention import VisionAttention
from engine.vision.weights import TowerWeights


def axis_rotary(
    cols: torch.Tensor, rows: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, ...]:
    """cos and sin ``[N, head_dim]`` for patches at (``cols``, ``rows``): each half of the head
    rotates on its own (VisionAttention's ``rotary_parts=2``), the first by the column, the second
    by the row, over ``head_dim / 4`` frequencies each."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    fx, fy = cols[:, None].float() * inv, rows[:, None].float() * inv
    angles = torch.cat([fx, fx, fy, fy], dim=-1)
    return angles.cos(), angles.sin()


class Gemma4Tower(nn.Module):
    def __init__(
        self,
        input_proj: nn.Module,
        position_table: torch.Tensor,
        blocks: list[EncoderBlock],
        embed_norm: nn.Module,
        embed_proj: nn.Module,
        pool: int,
        head_dim: int,
        theta: float,
        standardize: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.input_proj, self.blocks = input_proj, nn.ModuleList(blocks)
        self.position_table = nn.Parameter(position_table, requires_grad=False)  # [2, positions, hidden]
        self.embed_norm, self.embed_proj = embed_norm, embed_proj
        self.pool, self.head_dim, self.theta = pool, head_dim, theta
        bias, scale = standardize if standardize is not None else (None, None)
        self.register_buffer("std_bias", bias)
        self.register_buffer("std_scale", scale)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """``[rows * cols, 3 * p * p]`` patches in [0, 1], row-major -> ``[soft tokens, text hidden]``."""
        rows, cols = grid
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        r, c = r.flatten().to(patches.device), c.flatten().to(patches.device)
        x = self.input_proj((2 * (patches - 0.5)).to(self.position_table.dtype))
        x = x + (self.position_table[0][c] + self.position_table[1][r])  # column's, row's
        cos, sin = axis_rotary(c, r, self.head_dim, self.theta)
        everything = [(0, x.shape[0])]
        for block in self.blocks:
            x = block(x, everything, (cos, sin))
        return self.embed_proj(self.embed_norm(self._pooled(x, rows, cols).to(x.dtype)))

    def _pooled(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The mean of each ``pool x pool`` square of patches, row-major over the squares, times
        ``sqrt(hidden)`` in float32 (it may leave the float16 range), then standardised."""
        k, d = self.pool, x.shape[-1]
        squares = x.float().view(rows // k, k, cols // k, k, d).mean(dim=(1, 3)).reshape(-1, d)
        squares = squares * math.sqrt(d)
        if self.std_bias is not None:
            squares = (squares - self.std_bias.float()) * self.std_scale.float()
        return squares

    @classmethod
    def load(cls, tower: TowerWeights, embedder: TowerWeights, cfg: dict[str, Any]) -> Gemma4Tower:
        """The tower under ``tower`` and the projection into the language model under
        ``embedder``, as the vision config ``cfg`` shapes them."""
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        hidden = int(cfg["hidden_size"])
        blocks = [
            _block(tower, f"encoder.layers.{i}.", cfg, eps) for i in range(int(cfg["num_hidden_layers"]))
        ]
        standardize = (
            (tower.tensor("std_bias"), tower.tensor("std_scale")) if cfg.get("standardize") else None
        )
        return cls(
            DenseLinear(tower.tensor("patch_embedder.input_proj.weight")),
            tower.tensor("patch_embedder.position_embedding_table"),
            blocks,
            _unscaled(tower, hidden, eps),
            embedder.linear("embedding_projection"),
            int(cfg.get("pooling_kernel_size", 3)),
            _head_dim(cfg),
            float((cfg.get("rope_parameters") or {}).get("rope_theta", 100.0)),
            standardize,
        )


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def _unscaled(w: TowerWeights, dim: int, eps: float) -> RMSNorm:
    """An RMSNorm with no learned scale (the values', and the soft tokens' before projection)."""
    return RMSNorm(torch.ones(dim, dtype=w.dtype, device=w.device), eps)


def _linear(w: TowerWeights, key: str) -> nn.Module:
    """A tower linear (stored under ``key.linear``), clamped where the checkpoint has bounds."""
    inner = w.linear(f"{key}.linear")
    if not w.has(f"{key}.input_min"):
        return inner
    lo_in, hi_in, lo_out, hi_out = (w.tensor(f"{key}.{b}").reshape(1) for b in _BOUNDS)
    return ClippedLinear(inner, torch.cat([lo_in, hi_in]), torch.cat([lo_out, hi_out]))


_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _group(w: TowerWeights, prefix: str, names: tuple[str, ...]) -> ProjectionGroup:
    linears = [_linear(w, prefix + n) for n in names]
    return ProjectionGroup([(linear, [linear.out_features]) for linear in linears])


def _block(w: TowerWeights, p: str, cfg: dict[str, Any], eps: float) -> EncoderBlock:
    """Encoder layer ``p``: attention and gated MLP, each between a pre- and a post-norm."""
    head_dim, a = _head_dim(cfg), p + "self_attn."
    attention = VisionAttention(
        _group(w, a, ("q_proj", "k_proj", "v_proj")),
        _linear(w, a + "o_proj"),
        int(cfg["num_attention_heads"]),
        head_dim,
        scale=1.0,
        norms=(w.rms_norm(a + "q_norm", eps), w.rms_norm(a + "k_norm", eps), _unscaled(w, head_dim, eps)),
        rotary_parts=2,
    )
    mlp = GatedMLP(
        _group(w, p + "mlp.", ("gate_proj", "up_proj")),
        _linear(w, p + "mlp.down_proj"),
        cfg.get("hidden_activation", "gelu_pytorch_tanh"),
    )
    return EncoderBlock(
        w.rms_norm(p + "input_layernorm", eps),
        attention,
        w.rms_norm(p + "pre_feedforward_layernorm", eps),
        mlp,
        w.rms_norm(p + "post_attention_layernorm", eps),
        w.rms_norm(p + "post_feedforward_layernorm", eps),
    )
