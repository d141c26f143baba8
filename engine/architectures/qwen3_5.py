"""Qwen3.5: the Qwen3-Next hybrid (gated delta nets beside gated attention, ``1 + w`` norms) with
the delta nets' projections stored apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``) and a dense MLP in every layer. Qwen3_5ForCausalLM is the text model alone;
Qwen3_5ForConditionalGeneration adds Qwen3-VL's vision tower without its deepstack mergers, and
multimodal RoPE (interleaved, as Qwen3-VL's)."""

from dataclasses import replace

from engine.architectures.qwen2_5_vl import mrope_specs
from engine.architectures.qwen3_next import Qwen3NextHybrid
from engine.architectures.vision_language import VisionLanguage
from engine.config import ModelConfig
from engine.modules.rope import RopeSpec

MROPE_PARAMS = ("mrope_section", "mrope_interleaved")


class Qwen3_5(Qwen3NextHybrid):
    hf_names = ("Qwen3_5ForCausalLM",)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        # Text alone: every token's three positions are the same, which makes multimodal RoPE
        # plain RoPE; the sections a config may still list do not apply.
        specs = super().rope_specs(cfg)
        plain = {
            k: replace(s, params={n: v for n, v in s.params.items() if n not in MROPE_PARAMS})
            for k, s in specs.items()
        }
        return plain


class Qwen3_5VL(VisionLanguage, Qwen3NextHybrid):
    hf_names = ("Qwen3_5ForConditionalGeneration",)
    vision = "engine.vision.qwen3_vl:Qwen3VLVision"

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        specs = mrope_specs(super().rope_specs(cfg))
        return {k: replace(s, params={**s.params, "mrope_interleaved": True}) for k, s in specs.items()}
