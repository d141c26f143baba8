"""Mistral 3's image path (Pixtral tower): images keep their aspect ratio, shrunk to fit the
longest edge and padded up to whole merge blocks; a ViT with 2D RoPE encodes the patch grid;
the projector merges each 2x2 block of patches with a learned linear and maps it into the
language model. In the prompt each row of merged tokens is ``[IMG]`` repeated, followed by
``[IMG_BREAK]``, the last row by ``[IMG_END]``; only the ``[IMG]`` rows receive features."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.modules.encoder_block import EncoderBlock
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.patch_embedding import PatchEmbedding, patchify
from engine.modules.vision_attention import VisionAttention
from engine.vision.base import PreparedImage, VisionModel
from engine.vision.media import ImageFeatures
from engine.vision.preprocess import normalize, resize, to_rgb
from engine.vision.processor_config import ImageSettings
from engine.vision.tokens import special_token_id
from engine.vision.weights import TowerWeights, first_prefix

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def fit_longest_edge(height: int, width: int, longest: int, unit: int) -> tuple[int, int]:
    """Shrink (never enlarge) to fit ``longest``, then round each side up to a multiple of ``unit``."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return math.ceil(height / unit) * unit, math.ceil(width / unit) * unit


def pixtral_rotary(rows: int, cols: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE tables ``[rows * cols, head_dim]`` for a row-major patch grid: the even-indexed
    frequencies turn with the row, the odd-indexed ones with the column."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    freqs = torch.cat(
        [r.flatten()[:, None].float() * inv[0::2], c.flatten()[:, None].float() * inv[1::2]], dim=-1
    )
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class PixtralTower(nn.Module):
    def __init__(
        self,
        patch_embedding: PatchEmbedding,
        pre_norm: nn.Module,
        blocks: list[EncoderBlock],
        patch: int,
        head_dim: int,
        theta: float,
    ) -> None:
        super().__init__()
        self.patch_embedding, self.pre_norm, self.blocks = patch_embedding, pre_norm, nn.ModuleList(blocks)
        self.patch, self.head_dim, self.theta = patch, head_dim, theta

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        rows, cols = pixels.shape[1] // self.patch, pixels.shape[2] // self.patch
        h = self.pre_norm(self.patch_embedding(patchify(pixels, self.patch)))
        cos, sin = pixtral_rotary(rows, cols, self.head_dim, self.theta)
        rotary = (cos.to(h.device), sin.to(h.device))
        everything = [(0, h.shape[0])]
        for block in self.blocks:
            h = block(h, everything, rotary)
        return h

    @classmethod
    def load(cls, w: TowerWeights, cfg: dict[str, Any]) -> PixtralTower:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        act = cfg.get("hidden_act", "silu")
        blocks = []
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"transformer.layers.{i}."
            a = p + "attention."
            attention = VisionAttention(
                w.projections(a + "q_proj", a + "k_proj", a + "v_proj"),
                w.linear(a + "o_proj"),
                heads,
                head_dim,
            )
            f = p + "feed_forward."
            gate, up = w.linear(f + "gate_proj"), w.linear(f + "up_proj")
            mlp = GatedMLP(
                ProjectionGroup([(gate, [gate.out_features]), (up, [up.out_features])]),
                w.linear(f + "down_proj"),
                act,
            )
            blocks.append(
                EncoderBlock(
                    w.rms_norm(p + "attention_norm", 1e-5), attention, w.rms_norm(p + "ffn_norm", 1e-5), mlp
                )
            )
        rope = cfg.get("rope_parameters") or {}
        return cls(
            PatchEmbedding(w.tensor("patch_conv.weight"), w.optional("patch_conv.bias")),
            w.rms_norm("ln_pre", 1e-5),
            blocks,
            int(cfg["patch_size"]),
            head_dim,
            float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        )


class MergingProjector(nn.Module):
    """RMS-normalise patches, merge each ``merge x merge`` block with a learned linear, then a
    two-layer GELU MLP into the language model's width."""

    def __init__(self, norm: nn.Module, merging: nn.Module, mlp: FeedForward, merge: int) -> None:
        super().__init__()
        self.norm, self.merging, self.mlp, self.merge = norm, merging, mlp, merge

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        d = patches.shape[-1]
        grid = self.norm(patches).reshape(rows, cols, d).permute(2, 0, 1)[None]
        # Each block as one vector, channel-major then position in the block (unfold's layout).
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)[0].transpose(0, 1)
        return self.mlp(self.merging(blocks))


class Mistral3Vision(VisionModel):
    def __init__(
        self,
        tower: PixtralTower,
        projector: MergingProjector,
        settings: ImageSettings,
        merge: int,
        marker: str,
        row_break: str,
        end: str,
        image_token_id: int,
    ) -> None:
        super().__init__(marker, image_token_id)
        self.tower, self.projector, self.merge = tower, projector, merge
        self.row_break, self.end = row_break, end
        size = settings.get("size", {})
        self.longest_edge = int(size.get("longest_edge", 1540))
        self.resample = settings.resample(3)
        self.rescale, self.do_normalize = settings.rescale_factor, settings.do_normalize
        self.mean, self.std = settings.mean_std(CLIP_MEAN, CLIP_STD)

    @property
    def unit(self) -> int:
        return self.tower.patch * self.merge

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        rgb = to_rgb(image)
        h, w = fit_longest_edge(rgb.height, rgb.width, self.longest_edge, self.unit)
        pixels = normalize(
            resize(rgb, h, w, self.resample), self.rescale, self.mean, self.std, self.do_normalize
        )
        return pixels, (h // self.tower.patch, w // self.tower.patch)

    def placeholder(self, image: PreparedImage) -> str:
        rows, cols = image.grid[0] // self.merge, image.grid[1] // self.merge
        text = (self.marker * cols + self.row_break) * rows
        return text[: -len(self.row_break)] + self.end

    def run_tower(self, image: PreparedImage) -> ImageFeatures:
        patches = self.tower(image.pixels.to(self.device, self.dtype))
        return ImageFeatures(self.projector(patches, *image.grid))

    @classmethod
    def load(cls, config: ModelConfig, store, dtype, device, token_text) -> Mistral3Vision:
        vcfg = config.raw["vision_config"]
        root = first_prefix(store, ["vision_tower.", "model.vision_tower."], "patch_conv.weight")
        tower = PixtralTower.load(TowerWeights(store, root, dtype, device), vcfg)
        pw = TowerWeights(
            store,
            first_prefix(store, ["multi_modal_projector.", "model.multi_modal_projector."], "norm.weight"),
            dtype,
            device,
        )
        merge = int(config.raw.get("spatial_merge_size", 2))
        eps = float((config.raw.get("text_config") or {}).get("rms_norm_eps", 1e-5))
        act = config.raw.get("projector_hidden_act", "gelu")
        projector = MergingProjector(
            pw.rms_norm("norm", eps),
            pw.linear("patch_merger.merging_layer"),
            FeedForward(pw.linear("linear_1"), pw.linear("linear_2"), act),
            merge,
        )
        image_token_id = int(config.raw["image_token_index"])
        specials = []
        for name in ("[IMG_BREAK]", "[IMG_END]"):
            if special_token_id(config.directory, name) is None:
                raise ModelLoadError(f"{config.directory}: the tokenizer lacks the image token {name}")
            specials.append(name)
        return cls(
            tower,
            projector,
            ImageSettings.from_dir(config.directory),
            merge,
            token_text(image_token_id),
            *specials,
            image_token_id,
        )
