"""Qwen3-VL (Qwen3VLForConditionalGeneration): the Qwen3 decoder with interleaved multimodal
RoPE, and the deepstack ViT of ``engine.vision.qwen3_vl``."""

from dataclasses import replace

from engine.architectures.qwen2_5_vl import mrope_specs
from engine.architectures.qwen3 import Qwen3
from engine.architectures.vision_language import VisionLanguage
from engine.config import ModelConfig
from engine.modules.rope import RopeSpec


class Qwen3VL(VisionLanguage, Qwen3):
    hf_names = ("Qwen3VLForConditionalGeneration",)
    vision = "engine.vision.qwen3_vl:Qwen3VLVision"

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        # Qwen3-VL always interleaves the axes' frequencies, whether or not the config says so.
        specs = mrope_specs(super().rope_specs(cfg))
        return {k: replace(s, params={**s.params, "mrope_interleaved": True}) for k, s in specs.items()}
