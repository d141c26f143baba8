"""GLM-4.1V (Glm4vForConditionalGeneration): the GLM-4 decoder (sandwich norms, fused gate_up_proj,
RoPE on adjacent pairs of part of each head) with multimodal RoPE, and the vision tower of
``engine.vision.glm4v``. Its q/k/v projections always carry biases (transformers builds them so
whatever the config says), and the head turns whole where the config gives no
``partial_rotary_factor`` (GLM-4 alone defaults to half)."""

from dataclasses import replace

from engine.architectures.glm4 import Glm4
from engine.architectures.glm4_moe import states_partial_rotary
from engine.architectures.qwen2_5_vl import mrope_specs
from engine.architectures.vision_language import VisionLanguage
from engine.config import ModelConfig
from engine.modules.rope import RopeSpec

DEFAULT_MROPE_SECTION = [8, 12, 12]  # transformers' GLM-4V, where the config states none


def glm_mrope_specs(specs: dict[str, RopeSpec]) -> dict[str, RopeSpec]:
    """M-RoPE in contiguous t/h/w sections of the rotated pairs (not interleaved)."""
    specs = mrope_specs(specs)
    return {
        kind: replace(s, params={"mrope_section": DEFAULT_MROPE_SECTION, **s.params})
        for kind, s in specs.items()
    }


class Glm4v(VisionLanguage, Glm4):
    hf_names = ("Glm4vForConditionalGeneration",)
    vision = "engine.vision.glm4v:Glm4vVision"
    qkv_bias = True

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        specs = super().rope_specs(cfg)
        if not states_partial_rotary(cfg):
            specs = {kind: replace(s, partial_rotary_factor=1.0) for kind, s in specs.items()}
        return glm_mrope_specs(specs)
