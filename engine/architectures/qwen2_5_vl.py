"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): the Qwen2 decoder with multimodal RoPE, and
the windowed ViT of ``engine.vision.qwen2_5_vl``."""

from dataclasses import replace

from engine.architectures.qwen2 import Qwen2
from engine.architectures.vision_language import VisionLanguage
from engine.config import ModelConfig
from engine.modules.rope import RopeSpec


def mrope_specs(specs: dict[str, RopeSpec]) -> dict[str, RopeSpec]:
    """transformers 4 configs name M-RoPE as a rope type ("mrope"); its frequencies are default."""
    return {kind: replace(s, kind="default") if s.kind == "mrope" else s for kind, s in specs.items()}


class Qwen2_5_VL(VisionLanguage, Qwen2):
    hf_names = ("Qwen2_5_VLForConditionalGeneration",)
    vision = "engine.vision.qwen2_5_vl:Qwen2_5_VLVision"

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        return mrope_specs(super().rope_specs(cfg))
