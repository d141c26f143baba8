"""GLM-4V's image path (GLM-4.1V, GLM-4.5V): the Qwen-VL grid, patch order and M-RoPE placement,
with a ViT of its own. Patches are embedded and RMS-normalised, then given a learned square
position table resampled (bicubic) at each patch's place in the image's grid, and 2D RoPE; after
the blocks (RMSNorm, fused qkv, gated MLPs) each ``merge x merge`` block of patches is folded into
one row by a strided convolution, and a projector (linear, LayerNorm, GELU, gated MLP) maps it to
the language model. In the prompt an image is ``<|image|>`` once per merged token, between
``<|begin_of_image|>`` and ``<|end_of_image|>``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.modules.encoder_block import EncoderBlock
from engine.modules.linear import ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.patch_embedding import PatchEmbedding
from engine.modules.vision_attention import VisionAttention
from engine.vision.qwen2_5_vl import CLIP_MEAN, QwenVision
from engine.vision.qwen_grid import QwenImageProcessing, axial_rotary, block_order_coordinates, fit_grid
from engine.vision.weights import TowerWeights


def resampled_positions(table: torch.Tensor, rows: int, cols: int, coords: torch.Tensor) -> torch.Tensor:
    """Rows of the square position table ``[side * side, hidden]`` at the patches ``coords``
    (``[N, 2]`` row, column) of a ``rows x cols`` grid: the table is read as an image spanning
    the grid and sampled bicubically at each patch's centre (edges clamped), in fp32."""
    side = int(table.shape[0] ** 0.5)
    image = table.float().reshape(side, side, -1).permute(2, 0, 1)[None]  # [1, hidden, side, side]
    x = (coords[:, 1].float() + 0.5) / cols * 2 - 1
    y = (coords[:, 0].float() + 0.5) / rows * 2 - 1
    grid = torch.stack((x, y), dim=-1)[None, :, None, :].to(image.device)  # [1, N, 1, 2]
    sampled = F.grid_sample(image, grid, mode="bicubic", align_corners=False, padding_mode="border")
    return sampled[0, :, :, 0].transpose(0, 1).to(table.dtype)


def _gated_mlp(w: TowerWeights, prefix: str, activation: str) -> GatedMLP:
    gate, up = w.linear(prefix + "gate_proj"), w.linear(prefix + "up_proj")
    return GatedMLP(
        ProjectionGroup([(gate, [gate.out_features]), (up, [up.out_features])]),
        w.linear(prefix + "down_proj"),
        activation,
    )


class Glm4vTower(nn.Module):
    def __init__(
        self,
        patch_embedding: PatchEmbedding,
        post_conv_norm: nn.Module,
        position_table: torch.Tensor,
        blocks: list[EncoderBlock],
        post_norm: nn.Module,
        downsample: PatchEmbedding,
        merger: nn.Module,
        merge: int,
        head_dim: int,
        theta: float,
    ) -> None:
        super().__init__()
        self.patch_embedding, self.post_conv_norm = patch_embedding, post_conv_norm
        self.position_table = nn.Parameter(position_table, requires_grad=False)
        self.blocks, self.post_norm = nn.ModuleList(blocks), post_norm
        # A convolution with kernel = stride = merge over each merge block: the linear map of the
        # block's rows flattened channel-major, as a patch embedding reads its patches.
        self.downsample, self.merger = downsample, merger
        self.merge, self.head_dim, self.theta = merge, head_dim, theta

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        rows, cols = grid
        coords = block_order_coordinates(rows, cols, self.merge)
        h = self.post_conv_norm(self.patch_embedding(patches))
        h = h + resampled_positions(self.position_table, rows, cols, coords).to(h.device)
        cos, sin = axial_rotary(coords, self.head_dim, self.theta)
        rotary = (cos.to(h.device), sin.to(h.device))
        everything = [(0, h.shape[0])]
        for block in self.blocks:
            h = block(h, everything, rotary)
        h = self.post_norm(h)
        unit, hidden = self.merge * self.merge, h.shape[-1]
        blocks = h.reshape(-1, unit, hidden).transpose(1, 2).reshape(-1, hidden * unit)
        return self.merger(self.downsample(blocks))

    @classmethod
    def load(cls, w: TowerWeights, cfg: dict[str, Any]) -> Glm4vTower:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        eps = float(cfg.get("rms_norm_eps", 1e-5))
        act = cfg.get("hidden_act", "silu")
        blocks = []
        for i in range(int(cfg["depth"])):
            p = f"blocks.{i}."
            attention = VisionAttention(
                w.fused(p + "attn.qkv", 3), w.linear(p + "attn.proj"), heads, hidden // heads
            )
            mlp = _gated_mlp(w, p + "mlp.", act)
            blocks.append(
                EncoderBlock(w.rms_norm(p + "norm1", eps), attention, w.rms_norm(p + "norm2", eps), mlp)
            )
        merger = nn.Sequential(
            w.linear("merger.proj"),
            w.layer_norm("merger.post_projection_norm", 1e-5),
            nn.GELU(),
            _gated_mlp(w, "merger.", act),
        )
        rope = cfg.get("rope_parameters") or {}
        return cls(
            PatchEmbedding(w.tensor("patch_embed.proj.weight"), w.optional("patch_embed.proj.bias")),
            w.rms_norm("post_conv_layernorm", eps),
            w.tensor("embeddings.position_embedding.weight"),
            blocks,
            w.rms_norm("post_layernorm", eps),
            PatchEmbedding(w.tensor("downsample.weight"), w.optional("downsample.bias")),
            merger,
            int(cfg.get("spatial_merge_size", 2)),
            hidden // heads,
            float(rope.get("rope_theta", 10000.0)),
        )


class Glm4vImageProcessing(QwenImageProcessing):
    """The Qwen grid rules as GLM-4V's processor applies them: an image with a side shorter than
    one merged unit is first enlarged (aspect kept) until it is not, and the pixel bounds count a
    still image once per frame of a temporal patch."""

    default_pixels = (112 * 112, 28 * 28 * 15000)

    def fit(self, height: int, width: int) -> tuple[int, int]:
        factor = self.patch * self.merge
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        return fit_grid(height, width, factor, self.min_pixels, self.max_pixels, frames=self.temporal)


class Glm4vVision(QwenVision):
    processing_class = Glm4vImageProcessing

    @classmethod
    def load(cls, config: ModelConfig, store, dtype, device, token_text) -> Glm4vVision:
        return cls.load_with(Glm4vTower, config, store, dtype, device, token_text, CLIP_MEAN)
