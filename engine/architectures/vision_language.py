"""What vision-language families add to their text decoder's architecture: where the decoder's
tensors sit in the multimodal checkpoint, and which vision model reads images.

Checkpoints of one family are saved with different nestings (by the original authors, by
transformers 4 and 5), so a family lists its candidate ``(decoder prefix, lm_head)`` layouts and
the first whose embedding table the checkpoint holds is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from engine.architectures.base import ModelSpec, TensorNames
from engine.config import ModelConfig

LAYOUTS: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "lm_head"),
    ("language_model.model.", "language_model.lm_head"),
    ("model.", "lm_head"),
)


class VisionLanguage:
    """Mixin for an :class:`engine.architectures.base.Architecture` subclass."""

    names: ClassVar[TensorNames]
    layouts: ClassVar[tuple[tuple[str, str], ...]] = LAYOUTS
    vision: ClassVar[str]  # "module:Class" of the family's VisionModel (imported on use)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        """The decoder's spec; whether the head is tied to the embedding is the whole model's
        setting (the top level of config.json), which the text part may not repeat."""
        spec = super().spec(cfg)  # type: ignore[misc]
        tie = cfg.raw.get("tie_word_embeddings")
        return spec if tie is None else replace(spec, tie_word_embeddings=bool(tie))

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        for prefix, lm_head in self.layouts:
            if has(f"{prefix}{self.names.embed}.weight"):
                return replace(self.names, prefix=prefix, lm_head=lm_head)
        return self.names

    def vision_model(self, cfg: ModelConfig, store: Any, dtype: Any, device: Any) -> Any:
        import importlib

        from engine.vision.tokens import special_token_text

        module, name = self.vision.split(":")
        cls = getattr(importlib.import_module(module), name)
        return cls.load(cfg, store, dtype, device, special_token_text(cfg.directory)).eval()
