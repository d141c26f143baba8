"""The SigLIP vision tower (Zhai et al., 2023) as Gemma 3 uses it: fixed-size square input,
learned absolute position embeddings, pre-norm LayerNorm blocks, a final LayerNorm."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.modules.encoder_block import EncoderBlock
from engine.modules.feed_forward import FeedForward
from engine.modules.patch_embedding import PatchEmbedding, patchify
from engine.modules.vision_attention import VisionAttention
from engine.vision.weights import TowerWeights


class SiglipTower(nn.Module):
    def __init__(
        self,
        patch_embedding: PatchEmbedding,
        position_embedding: torch.Tensor,
        blocks: list[EncoderBlock],
        final_norm: nn.Module,
        patch_size: int,
    ) -> None:
        super().__init__()
        self.patch_embedding = patch_embedding
        self.position_embedding = nn.Parameter(position_embedding, requires_grad=False)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm, self.patch_size = final_norm, patch_size

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[3, S, S]`` -> ``[(S / patch)^2, hidden]``."""
        h = self.patch_embedding(patchify(pixels, self.patch_size)) + self.position_embedding
        everything = [(0, h.shape[0])]
        for block in self.blocks:
            h = block(h, everything)
        return self.final_norm(h)

    @classmethod
    def load(cls, w: TowerWeights, cfg: dict[str, Any]) -> SiglipTower:
        eps = float(cfg.get("layer_norm_eps", 1e-6))
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg["hidden_size"]) // heads
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        blocks = []
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"encoder.layers.{i}."
            attention = VisionAttention(
                w.projections(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"),
                w.linear(p + "self_attn.out_proj"),
                heads,
                head_dim,
            )
            mlp = FeedForward(w.linear(p + "mlp.fc1"), w.linear(p + "mlp.fc2"), act)
            blocks.append(
                EncoderBlock(
                    w.layer_norm(p + "layer_norm1", eps), attention, w.layer_norm(p + "layer_norm2", eps), mlp
                )
            )
        return cls(
            PatchEmbedding(
                w.tensor("embeddings.patch_embedding.weight"), w.optional("embeddings.patch_embedding.bias")
            ),
            w.tensor("embeddings.position_embedding.weight"),
            blocks,
            w.layer_norm("post_layernorm", eps),
            int(cfg["patch_size"]),
        )
