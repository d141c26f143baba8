"""What the Qwen-VL families share: the dynamic-resolution grid, its patch order, 2D rotary
positions of patches, and the multimodal RoPE positions of the prompt.

An image is resized (keeping its aspect ratio) to a multiple of ``patch * merge`` on both sides
with its pixel count between ``min_pixels`` and ``max_pixels``; its patches are ordered block by
block, each ``merge x merge`` block of neighbours consecutive, because the tower's last step
merges every block into one token of the language model.
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from engine.vision.images import ImageInputError
from engine.vision.media import ImagePlacement
from engine.vision.preprocess import normalize, resize, to_rgb
from engine.vision.processor_config import ImageSettings

MAX_ASPECT = 200  # the Qwen processors refuse more elongated images


def fit_grid(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1
) -> tuple[int, int]:
    """The resized ``(height, width)``: multiples of ``factor``, pixel count within bounds. The
    bounds count ``frames`` copies of the image (GLM-4V counts a still image as the frames of one
    temporal patch)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageInputError(f"image of {width}x{height} is too elongated (aspect ratio above {MAX_ASPECT})")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if frames * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def block_order_patches(pixels: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[patches, C * temporal * patch * patch]`` in merge-block order. A still
    image fills every temporal slot of the tower's 3D patch with the same frame."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    blocks = pixels.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)  # block row, block col, row in block, col in block, C, p, p
    frames = blocks[:, :, :, :, :, None].expand(*blocks.shape[:5], temporal, patch, patch)
    return frames.reshape(gh * gw, c * temporal * patch * patch)


def block_order_coordinates(rows: int, cols: int, merge: int) -> torch.Tensor:
    """``[rows * cols, 2]`` (row, column) of each patch, in merge-block order."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    shape = (rows // merge, merge, cols // merge, merge)
    return torch.stack(
        [r.reshape(shape).transpose(1, 2).flatten(), c.reshape(shape).transpose(1, 2).flatten()], -1
    )


def axial_rotary(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE tables ``[N, head_dim]``: the first half of each head's pairs turns with the row,
    the second with the column (rotate-half layout)."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    freqs = torch.cat([coords[:, 0, None].float() * inv, coords[:, 1, None].float() * inv], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class QwenImageProcessing:
    """The Qwen2-VL image processor's settings and steps."""

    # (min, max) pixels where preprocessor_config.json states none
    default_pixels: tuple[int, int] = (56 * 56, 28 * 28 * 1280)

    def __init__(
        self, settings: ImageSettings, patch: int, merge: int, temporal: int, mean: list[float]
    ) -> None:
        size = settings.get("size", {})
        low, high = self.default_pixels
        self.min_pixels = int(settings.get("min_pixels", size.get("shortest_edge", low)))
        self.max_pixels = int(settings.get("max_pixels", size.get("longest_edge", high)))
        self.patch = int(settings.get("patch_size", patch))
        self.merge = int(settings.get("merge_size", merge))
        self.temporal = int(settings.get("temporal_patch_size", temporal))
        self.resample = settings.resample(3)
        self.rescale, self.do_normalize = settings.rescale_factor, settings.do_normalize
        std = [0.26862954, 0.26130258, 0.27577711] if mean[0] != 0.5 else [0.5] * 3
        self.mean, self.std = settings.mean_std(mean, std)

    def fit(self, height: int, width: int) -> tuple[int, int]:
        """The size an image of ``height x width`` is resized to."""
        return fit_grid(height, width, self.patch * self.merge, self.min_pixels, self.max_pixels)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        rgb = to_rgb(image)
        h, w = self.fit(rgb.height, rgb.width)
        pixels = normalize(
            resize(rgb, h, w, self.resample), self.rescale, self.mean, self.std, self.do_normalize
        )
        return block_order_patches(pixels, self.patch, self.merge, self.temporal), (
            h // self.patch,
            w // self.patch,
        )


def mrope_positions(
    length: int, placements: list[ImagePlacement], grids: list[tuple[int, int]]
) -> tuple[torch.Tensor, int]:
    """``[3, length]`` positions and the offset after the prompt. Text advances all three axes by
    one per token; an image of ``rows x cols`` merged tokens starting at position ``p`` takes
    ``(p, p + row, p + col)``, and the text after it resumes at ``p + max(rows, cols)``."""
    out = torch.empty(3, length, dtype=torch.long)
    cursor, next_pos = 0, 0
    for placement, (rows, cols) in zip(placements, grids):
        start = int(placement.positions[0])
        n_text = start - cursor
        out[:, cursor:start] = torch.arange(next_pos, next_pos + n_text)
        next_pos += n_text
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        out[0, start : start + rows * cols] = next_pos
        out[1, start : start + rows * cols] = next_pos + r.flatten()
        out[2, start : start + rows * cols] = next_pos + c.flatten()
        next_pos += max(rows, cols)
        cursor = start + rows * cols
    out[:, cursor:] = torch.arange(next_pos, next_pos + length - cursor)
    next_pos += length - cursor
    return out, next_pos - length
