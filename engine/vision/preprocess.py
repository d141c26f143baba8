"""The steps every family's image preprocessing is made of, with the numerics of transformers'
Pillow image processors (their reference path): RGB conversion onto white, a Pillow resize,
rescaling through float64, normalization in float32, channels first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

RESAMPLE = {
    0: Image.Resampling.NEAREST,
    1: Image.Resampling.LANCZOS,
    2: Image.Resampling.BILINEAR,
    3: Image.Resampling.BICUBIC,
    4: Image.Resampling.BOX,
    5: Image.Resampling.HAMMING,
}


def to_rgb(image: Image.Image) -> Image.Image:
    """Transparent images are composited onto white (what a viewer shows), others converted."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    if (image.height, image.width) == (height, width):
        return image
    return image.resize((width, height), resample=RESAMPLE[resample])


def normalize(
    image: Image.Image, rescale: float, mean: Sequence[float], std: Sequence[float], do_normalize: bool = True
) -> torch.Tensor:
    """``[3, H, W]`` float32: ``(pixel * rescale - mean) / std``."""
    pixels = np.asarray(image).astype(np.float64) * rescale
    pixels = pixels.astype(np.float32)
    if do_normalize:
        pixels = (pixels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
