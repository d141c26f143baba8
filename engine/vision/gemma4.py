"""Gemma 4's image path: an image keeps its aspect ratio, resized to the largest size whose
sides are multiples of ``pool * patch`` and whose patches fit the soft-token budget
(``max_soft_tokens * pool**2``); its pixels stay in [0, 1] (no normalisation); the tower
(``engine.vision.gemma4_tower``) makes one soft token per ``pool x pool`` square of patches. In
the prompt an image is ``<|image>``, its soft tokens (the template's ``<|image|>`` marker, once
each) and ``<image|>``, as Gemma4Processor expands it. Where the text config says
``use_bidirectional_attention: "vision"`` an image's tokens see each other in the sliding layers.

The small sizes' audio tower is not loaded: a prompt with audio is refused by name
(``engine.vision.prompt``)."""

from __future__ import annotations

import math

import torch
from PIL import Image

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.vision.base import PreparedImage, VisionModel
from engine.vision.gemma4_tower import Gemma4Tower
from engine.vision.images import ImageInputError
from engine.vision.media import ImageFeatures
from engine.vision.preprocess import normalize, resize, to_rgb
from engine.vision.processor_config import ImageSettings
from engine.vision.weights import TowerWeights, first_prefix

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # what Gemma4ImageProcessor accepts


def fit_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple[int, int]:
    """The resized ``(height, width)``: the image's aspect ratio scaled to ``max_patches``
    patches, each side rounded down to a multiple of ``pool * patch``; a side that rounds to 0
    gets one such unit, the other the image's (integer) aspect ratio in units, capped."""
    unit = pool * patch
    factor = math.sqrt(max_patches * patch * patch / (height * width))
    h, w = math.floor(factor * height / unit) * unit, math.floor(factor * width / unit) * unit
    if h == 0 and w == 0:
        raise ImageInputError(f"an image of {width}x{height} is too small to cut into {unit}-pixel tiles")
    longest = (max_patches // pool**2) * unit
    if h == 0:
        h, w = unit, min(math.floor(width / height) * unit, longest)
    elif w == 0:
        h, w = min(math.floor(height / width) * unit, longest), unit
    if h * w > max_patches * patch * patch:
        raise ImageInputError(f"an image of {width}x{height} needs more than {max_patches} patches")
    return h, w


def patches_of(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """``[3, H, W]`` -> ``[(H/p) * (W/p), p * p * 3]``, patches row-major, each flattened row by row
    with the channels innermost (Gemma 4's layout, not a convolution's)."""
    c, h, w = pixels.shape
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return grid.permute(1, 3, 2, 4, 0).reshape((h // patch) * (w // patch), patch * patch * c)


class Gemma4Vision(VisionModel):
    audio_refusal = (
        "Gemma 4's audio input is not supported: this engine runs Gemma 4's text and image parts, "
        "not its audio tower; send the text (and images) without the audio"
    )

    def __init__(
        self,
        tower: Gemma4Tower,
        settings: ImageSettings,
        patch: int,
        pool: int,
        tokens: tuple[str, str, str],
        image_token_id: int,
        bidirectional: bool,
        audio_marker: str | None,
    ) -> None:
        marker, self.begin, self.end = tokens
        super().__init__(marker, image_token_id)
        self.tower, self.patch, self.pool = tower, patch, pool
        self.bidirectional, self.audio_marker = bidirectional, audio_marker
        budget = int(settings.get("max_soft_tokens", 280))
        if budget not in SOFT_TOKEN_BUDGETS:
            raise ModelLoadError(f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, not {budget}")
        self.max_patches = budget * pool * pool
        self.resample = settings.resample(3)
        self.rescale, self.do_normalize = settings.rescale_factor, bool(settings.get("do_normalize", False))
        self.mean, self.std = settings.mean_std([0.0] * 3, [1.0] * 3)

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        rgb = to_rgb(image)
        height, width = fit_size(rgb.height, rgb.width, self.patch, self.max_patches, self.pool)
        pixels = normalize(
            resize(rgb, height, width, self.resample), self.rescale, self.mean, self.std, self.do_normalize
        )
        return patches_of(pixels, self.patch), (height // self.patch, width // self.patch)

    def placeholder(self, image: PreparedImage) -> str:
        rows, cols = image.grid
        return f"{self.begin}{self.marker * (rows * cols // self.pool**2)}{self.end}"

    def run_tower(self, image: PreparedImage) -> ImageFeatures:
        return ImageFeatures(self.tower(image.pixels.to(self.device), image.grid))

    @classmethod
    def load(cls, config: ModelConfig, store, dtype, device, token_text) -> Gemma4Vision:
        vcfg = config.raw.get("vision_config")
        if not isinstance(vcfg, dict):
            raise ModelLoadError(f"{config.directory / 'config.json'} has no vision_config")
        root = first_prefix(
            store, ["model.vision_tower.", "vision_tower."], "patch_embedder.input_proj.weight"
        )
        projector = first_prefix(
            store, ["model.embed_vision.", "embed_vision."], "embedding_projection.weight"
        )
        tower = Gemma4Tower.load(
            TowerWeights(store, root, dtype, device), TowerWeights(store, projector, dtype, device), vcfg
        )
        raw = config.raw
        tokens = tuple(token_text(int(raw[k])) for k in ("image_token_id", "boi_token_id", "eoi_token_id"))
        audio_marker = None  # the audio clips' placeholder, refused wherever a prompt has it
        if raw.get("audio_token_id") is not None:
            try:
                audio_marker = token_text(int(raw["audio_token_id"]))
            except ModelLoadError:  # a tokenizer without the audio token: nothing to look for
                audio_marker = None
        return cls(
            tower,
            ImageSettings.from_dir(config.directory),
            int(vcfg.get("patch_size", 16)),
            int(vcfg.get("pooling_kernel_size", 3)),
            tokens,
            int(raw["image_token_id"]),
            config.get("use_bidirectional_attention") == "vision",
            audio_marker,
        )
