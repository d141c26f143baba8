"""Gemma 3's image path: every image is resized to the SigLIP tower's square input, encoded,
average-pooled to ``mm_tokens_per_image`` tokens, normalised and projected into the language
model. In the prompt an image is ``<start_of_image>`` followed by that many soft tokens and
``<end_of_image>``, set apart by blank lines; the language model attends bidirectionally
among one image's soft tokens."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from engine.config import ModelConfig
from engine.modules.norms import RMSNorm
from engine.vision.base import PreparedImage, VisionModel
from engine.vision.media import ImageFeatures
from engine.vision.preprocess import normalize, resize, to_rgb
from engine.vision.processor_config import ImageSettings
from engine.vision.siglip import SiglipTower
from engine.vision.weights import TowerWeights, first_prefix


class PooledProjector(nn.Module):
    """Average-pool the square patch grid by ``kernel``, RMS-normalise, project (``x @ W``)."""

    def __init__(self, norm: RMSNorm, weight: torch.Tensor, grid_side: int, kernel: int) -> None:
        super().__init__()
        self.norm = norm
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vision hidden, text hidden]
        self.grid_side, self.kernel = grid_side, kernel

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        hidden = patches.shape[-1]
        grid = patches.transpose(0, 1).reshape(1, hidden, self.grid_side, self.grid_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].transpose(0, 1)
        return torch.matmul(self.norm(pooled), self.weight)


class Gemma3Vision(VisionModel):
    bidirectional = True

    def __init__(
        self,
        tower: SiglipTower,
        projector: PooledProjector,
        settings: ImageSettings,
        image_size: int,
        tokens_per_image: int,
        marker: str,
        soft_token: str,
        end_token: str,
        image_token_id: int,
    ) -> None:
        super().__init__(marker, image_token_id)
        self.tower, self.projector = tower, projector
        self.image_size, self.tokens_per_image = image_size, tokens_per_image
        self.soft_token, self.end_token = soft_token, end_token
        size = settings.get("size", {})
        self.height = int(size.get("height", image_size))
        self.width = int(size.get("width", image_size))
        self.resample = settings.resample(2)
        self.rescale, self.do_normalize = settings.rescale_factor, settings.do_normalize
        self.mean, self.std = settings.mean_std([0.5] * 3, [0.5] * 3)

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        resized = resize(to_rgb(image), self.height, self.width, self.resample)
        return normalize(resized, self.rescale, self.mean, self.std, self.do_normalize), (
            self.height,
            self.width,
        )

    def placeholder(self, image: PreparedImage) -> str:
        return f"\n\n{self.marker}{self.soft_token * self.tokens_per_image}{self.end_token}\n\n"

    def run_tower(self, image: PreparedImage) -> ImageFeatures:
        patches = self.tower(image.pixels.to(self.device, self.dtype))
        return ImageFeatures(self.projector(patches))

    @classmethod
    def load(cls, config: ModelConfig, store, dtype, device, token_text) -> Gemma3Vision:
        vcfg = config.raw["vision_config"]
        root = first_prefix(
            store,
            [
                "vision_tower.vision_model.",
                "vision_tower.",
                "model.vision_tower.vision_model.",
                "model.vision_tower.",
            ],
            "embeddings.patch_embedding.weight",
        )
        tower = SiglipTower.load(TowerWeights(store, root, dtype, device), vcfg)
        proj_root = first_prefix(
            store, ["multi_modal_projector.", "model.multi_modal_projector."], "mm_input_projection_weight"
        )
        pw = TowerWeights(store, proj_root, dtype, device)
        image_size, patch = int(vcfg["image_size"]), int(vcfg["patch_size"])
        tokens = int(config.raw.get("mm_tokens_per_image", 256))
        side = image_size // patch
        kernel = side // int(math.isqrt(tokens))
        projector = PooledProjector(
            pw.rms_norm("mm_soft_emb_norm", float(vcfg.get("layer_norm_eps", 1e-6)), offset=1.0),
            pw.tensor("mm_input_projection_weight"),
            side,
            kernel,
        )
        boi, soft, eoi = (
            token_text(config.raw[k]) for k in ("boi_token_index", "image_token_index", "eoi_token_index")
        )
        return cls(
            tower,
            projector,
            ImageSettings.from_dir(config.directory),
            image_size,
            tokens,
            boi,
            soft,
            eoi,
            int(config.raw["image_token_index"]),
        )
