"""Qwen3-VL's image path: the Qwen grid and M-RoPE placement of Qwen2.5-VL, with a plain ViT
(full attention, LayerNorm, learned position embeddings interpolated to each image's grid)
whose intermediate layers also feed the language model: "deepstack" mergers turn the outputs
of chosen tower layers into extra rows added to the image tokens' hidden states after the first
decoder layers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.modules.encoder_block import EncoderBlock
from engine.modules.feed_forward import FeedForward
from engine.modules.patch_embedding import PatchEmbedding
from engine.modules.vision_attention import VisionAttention
from engine.vision.media import ImageFeatures
from engine.vision.qwen2_5_vl import PatchMerger, QwenVision
from engine.vision.qwen_grid import axial_rotary, block_order_coordinates
from engine.vision.weights import TowerWeights


class DeepstackTower(nn.Module):
    def __init__(
        self,
        patch_embedding: PatchEmbedding,
        position_table: torch.Tensor,
        blocks: list[EncoderBlock],
        merger: PatchMerger,
        deepstack: dict[int, PatchMerger],
        merge: int,
        head_dim: int,
        theta: float,
    ) -> None:
        super().__init__()
        self.patch_embedding, self.blocks, self.merger = patch_embedding, nn.ModuleList(blocks), merger
        self.position_table = nn.Parameter(position_table, requires_grad=False)  # [side * side, hidden]
        self.deepstack_layers = list(deepstack)
        self.deepstack = nn.ModuleList(deepstack.values())
        self.merge, self.head_dim, self.theta = merge, head_dim, theta

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The learned square position table, bilinearly resized (corners aligned) to the grid,
        in merge-block order."""
        side = int(self.position_table.shape[0] ** 0.5)
        table = self.position_table.float().reshape(side, side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(rows, cols), mode="bilinear", align_corners=True)[0]
        coords = block_order_coordinates(rows, cols, self.merge)
        return grid[:, coords[:, 0], coords[:, 1]].transpose(0, 1).to(self.position_table.dtype)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> ImageFeatures:
        rows, cols = grid
        h = self.patch_embedding(patches) + self.positions(rows, cols).to(patches.device)
        cos, sin = axial_rotary(block_order_coordinates(rows, cols, self.merge), self.head_dim, self.theta)
        rotary = (cos.to(h.device), sin.to(h.device))
        everything = [(0, h.shape[0])]
        deep = []
        for i, block in enumerate(self.blocks):
            h = block(h, everything, rotary)
            if i in self.deepstack_layers:
                deep.append(self.deepstack[self.deepstack_layers.index(i)](h))
        return ImageFeatures(self.merger(h), deep)

    @classmethod
    def load(cls, w: TowerWeights, cfg: dict[str, Any]) -> DeepstackTower:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        merge = int(cfg.get("spatial_merge_size", 2))
        unit = merge * merge
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        blocks = []
        for i in range(int(cfg["depth"])):
            p = f"blocks.{i}."
            attention = VisionAttention(
                w.fused(p + "attn.qkv", 3), w.linear(p + "attn.proj"), heads, hidden // heads
            )
            mlp = FeedForward(w.linear(p + "mlp.linear_fc1"), w.linear(p + "mlp.linear_fc2"), act)
            blocks.append(
                EncoderBlock(w.layer_norm(p + "norm1", 1e-6), attention, w.layer_norm(p + "norm2", 1e-6), mlp)
            )

        def merger(key: str, after: bool) -> PatchMerger:
            mlp = FeedForward(w.linear(key + "linear_fc1"), w.linear(key + "linear_fc2"), "gelu")
            return PatchMerger(w.layer_norm(key + "norm", 1e-6), mlp, unit, norm_after_merge=after)

        layers = [int(i) for i in cfg.get("deepstack_visual_indexes", [])]
        deepstack = {layer: merger(f"deepstack_merger_list.{k}.", True) for k, layer in enumerate(layers)}
        rope = cfg.get("rope_parameters") or {}
        return cls(
            PatchEmbedding(w.tensor("patch_embed.proj.weight"), w.optional("patch_embed.proj.bias")),
            w.tensor("pos_embed.weight"),
            blocks,
            merger("merger.", False),
            deepstack,
            merge,
            hidden // heads,
            float(rope.get("rope_theta", 10000.0)),
        )


class Qwen3VLVision(QwenVision):
    @classmethod
    def load(cls, config: ModelConfig, store, dtype, device, token_text) -> Qwen3VLVision:
        return cls.load_with(DeepstackTower, config, store, dtype, device, token_text, [0.5, 0.5, 0.5])
