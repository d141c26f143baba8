"""Qwen2.5-VL's image path: a dynamic-resolution ViT with 2D RoPE whose blocks attend within
local windows except a few full-attention ones, then an MLP merging each 2x2 block of patches
into one token of the language model. In the prompt an image is ``<|image_pad|>`` repeated
once per merged token (between ``<|vision_start|>`` and ``<|vision_end|>``), placed by M-RoPE."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torch import nn

from engine.config import ModelConfig
from engine.modules.encoder_block import EncoderBlock
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.patch_embedding import PatchEmbedding
from engine.modules.vision_attention import VisionAttention
from engine.vision.base import PreparedImage, VisionModel
from engine.vision.media import ImageFeatures, ImagePlacement
from engine.vision.processor_config import ImageSettings
from engine.vision.qwen_grid import (
    QwenImageProcessing,
    axial_rotary,
    block_order_coordinates,
    mrope_positions,
)
from engine.vision.weights import TowerWeights, first_prefix

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]


def window_partition(rows: int, cols: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged units (``merge x merge`` patch blocks) grouped into ``window x window`` windows,
    windows in row-major order: the units' new order, and each window's size in units."""
    units = torch.arange((rows // merge) * (cols // merge)).reshape(rows // merge, cols // merge)
    order, sizes = [], []
    for r in range(0, units.shape[0], window):
        for c in range(0, units.shape[1], window):
            block = units[r : r + window, c : c + window].flatten()
            order.append(block)
            sizes.append(block.numel())
    return torch.cat(order), sizes


class PatchMerger(nn.Module):
    """Normalise each patch, concatenate each ``merge x merge`` block, MLP into the LM's width.
    ``norm_after_merge`` normalises the concatenated block instead (Qwen3-VL's deepstack)."""

    def __init__(self, norm: nn.Module, mlp: FeedForward, unit: int, norm_after_merge: bool = False) -> None:
        super().__init__()
        self.norm, self.mlp, self.unit, self.norm_after_merge = norm, mlp, unit, norm_after_merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_merge:
            return self.mlp(self.norm(x.reshape(-1, x.shape[-1] * self.unit)))
        return self.mlp(self.norm(x).reshape(-1, x.shape[-1] * self.unit))


class WindowedTower(nn.Module):
    def __init__(
        self,
        patch_embedding: PatchEmbedding,
        blocks: list[EncoderBlock],
        full_attention: set[int],
        merger: PatchMerger,
        merge: int,
        window: int,
        head_dim: int,
        theta: float,
    ) -> None:
        super().__init__()
        self.patch_embedding, self.blocks, self.merger = patch_embedding, nn.ModuleList(blocks), merger
        self.full_attention, self.merge, self.window = full_attention, merge, window
        self.head_dim, self.theta = head_dim, theta

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        rows, cols = grid
        unit = self.merge * self.merge
        order, sizes = window_partition(rows, cols, self.merge, self.window)
        # Reorder whole merged units so each window's patches are contiguous.
        patch_order = (order[:, None] * unit + torch.arange(unit)).flatten().to(patches.device)
        h = self.patch_embedding(patches)[patch_order]
        cos, sin = axial_rotary(block_order_coordinates(rows, cols, self.merge), self.head_dim, self.theta)
        rotary = (cos.to(h.device)[patch_order], sin.to(h.device)[patch_order])
        bounds = torch.tensor([0, *sizes]).cumsum(0) * unit
        windows = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        everything = [(0, h.shape[0])]
        for i, block in enumerate(self.blocks):
            h = block(h, everything if i in self.full_attention else windows, rotary)
        return self.merger(h)[torch.argsort(order).to(h.device)]

    @classmethod
    def load(cls, w: TowerWeights, cfg: dict[str, Any]) -> WindowedTower:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        merge = int(cfg.get("spatial_merge_size", 2))
        act = cfg.get("hidden_act", "silu")
        blocks = []
        for i in range(int(cfg["depth"])):
            p = f"blocks.{i}."
            attention = VisionAttention(
                w.fused(p + "attn.qkv", 3), w.linear(p + "attn.proj"), heads, hidden // heads
            )
            gate, up = w.linear(p + "mlp.gate_proj"), w.linear(p + "mlp.up_proj")
            mlp = GatedMLP(
                ProjectionGroup([(gate, [gate.out_features]), (up, [up.out_features])]),
                w.linear(p + "mlp.down_proj"),
                act,
            )
            blocks.append(
                EncoderBlock(w.rms_norm(p + "norm1", 1e-6), attention, w.rms_norm(p + "norm2", 1e-6), mlp)
            )
        merger = PatchMerger(
            w.rms_norm("merger.ln_q", 1e-6),
            FeedForward(w.linear("merger.mlp.0"), w.linear("merger.mlp.2"), "gelu"),
            merge * merge,
        )
        rope = cfg.get("rope_parameters") or {}
        return cls(
            PatchEmbedding(w.tensor("patch_embed.proj.weight"), w.optional("patch_embed.proj.bias")),
            blocks,
            set(int(i) for i in cfg.get("fullatt_block_indexes", [])),
            merger,
            merge,
            int(cfg.get("window_size", 112)) // merge // int(cfg["patch_size"]),
            hidden // heads,
            float(rope.get("rope_theta", 10000.0)),
        )


class QwenVision(VisionModel):
    """The Qwen-VL families' image path around their tower: processing, placeholders, M-RoPE."""

    processing_class: type[QwenImageProcessing] = QwenImageProcessing  # GLM-4V's sizes differ

    def __init__(
        self, tower: nn.Module, processing: QwenImageProcessing, marker: str, image_token_id: int
    ) -> None:
        super().__init__(marker, image_token_id)
        self.tower, self.processing = tower, processing

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        return self.processing(image)

    def merged_grid(self, image: PreparedImage) -> tuple[int, int]:
        m = self.processing.merge
        return image.grid[0] // m, image.grid[1] // m

    def placeholder(self, image: PreparedImage) -> str:
        rows, cols = self.merged_grid(image)
        return self.marker * (rows * cols)

    def run_tower(self, image: PreparedImage) -> ImageFeatures:
        out = self.tower(image.pixels.to(self.device, self.dtype), image.grid)
        return out if isinstance(out, ImageFeatures) else ImageFeatures(out)

    def rope_positions(
        self, token_ids: list[int], placements: list[ImagePlacement], images: list[PreparedImage]
    ) -> tuple[torch.Tensor, int]:
        return mrope_positions(len(token_ids), placements, [self.merged_grid(image) for image in images])

    @classmethod
    def load_with(
        cls, tower_class, config: ModelConfig, store, dtype, device, token_text, mean
    ) -> QwenVision:
        vcfg = config.raw["vision_config"]
        root = first_prefix(store, ["model.visual.", "visual."], "patch_embed.proj.weight")
        tower = tower_class.load(TowerWeights(store, root, dtype, device), vcfg)
        processing = cls.processing_class(
            ImageSettings.from_dir(config.directory),
            int(vcfg["patch_size"]),
            int(vcfg.get("spatial_merge_size", 2)),
            int(vcfg.get("temporal_patch_size", 2)),
            mean,
        )
        image_token_id = int(config.raw["image_token_id"])
        return cls(tower, processing, token_text(image_token_id), image_token_id)


class Qwen2_5_VLVision(QwenVision):
    @classmethod
    def load(cls, config: ModelConfig, store, dtype, device, token_text) -> Qwen2_5_VLVision:
        return cls.load_with(WindowedTower, config, store, dtype, device, token_text, CLIP_MEAN)
