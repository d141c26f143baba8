"""What every family's vision model provides, and the encoding cache they share."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image
from torch import nn

from engine.vision.images import content_hash
from engine.vision.media import ImageFeatures, ImagePlacement


@dataclass
class PreparedImage:
    """An image after preprocessing: the tower's input, the patch grid it makes (family
    specific: rows x columns of patches before any merging) and its content hash."""

    pixels: torch.Tensor
    grid: tuple[int, int]
    key: str


class VisionModel(nn.Module):
    """One family's image path: preprocessing, prompt placeholders, tower and projector.

    ``marker`` is the text a chat template writes where an image goes; :meth:`placeholder`
    is what it becomes once the image's size is known (the processor's expansion), and the
    language model's rows at ``image_token_id`` receive the image's features in order.
    """

    bidirectional: ClassVar[bool] = False  # image tokens attend to each other (Gemma 3)
    cache_size: ClassVar[int] = 16  # encoded images kept, most recently used last
    # Audio: what a prompt with some is told (no family here hears it), and the text the chat
    # template writes for a clip where the model has an audio tower we do not run (Gemma 4).
    audio_refusal: ClassVar[str] = "this model takes no audio input"
    audio_marker: str | None = None

    def __init__(self, marker: str, image_token_id: int) -> None:
        super().__init__()
        self.marker, self.image_token_id = marker, image_token_id
        self._encoded: OrderedDict[str, ImageFeatures] = OrderedDict()
        self.encode_calls = 0  # images actually run through the tower (statistics, tests)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # -- what a family defines ------------------------------------------------------------

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        raise NotImplementedError

    def placeholder(self, image: PreparedImage) -> str:
        raise NotImplementedError

    def run_tower(self, image: PreparedImage) -> ImageFeatures:
        raise NotImplementedError

    def rope_positions(
        self, token_ids: list[int], placements: list[ImagePlacement], images: list[PreparedImage]
    ) -> tuple[torch.Tensor, int] | None:
        """Multimodal RoPE positions ``[3, len(token_ids)]`` and the offset of positions after
        the prompt; None for families with plain positions."""
        return None

    # -- shared ---------------------------------------------------------------------------

    def prepare(self, image: Image.Image) -> PreparedImage:
        pixels, grid = self.preprocess(image)
        return PreparedImage(pixels, grid, content_hash(image))

    @torch.inference_mode()
    def encode(self, image: PreparedImage) -> ImageFeatures:
        """The image's features, from the cache when this picture was encoded recently."""
        cached = self._encoded.get(image.key)
        if cached is not None:
            self._encoded.move_to_end(image.key)
            return cached
        features = self.run_tower(image)
        self.encode_calls += 1
        self._encoded[image.key] = features
        while len(self._encoded) > self.cache_size:
            self._encoded.popitem(last=False)
        return features

    def describe(self) -> dict[str, Any]:
        return {"family": type(self).__name__, "image_token_id": self.image_token_id}
