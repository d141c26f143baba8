"""GLM-4.5V (Glm4vMoeForConditionalGeneration): the GLM-4.5 decoder (pre-norm layers, dense first
``first_k_dense_replace`` layers then DeepSeek-V3 mixtures of experts with a shared expert, RoPE
on half of each head in the rotate-half layout) with multimodal RoPE, and GLM-4V's vision tower.
q/k/v biases unless ``attention_bias`` is false (transformers' default is true); no q/k norms."""

from dataclasses import replace

from engine.architectures.glm4_moe import Glm4Moe
from engine.architectures.glm4v import glm_mrope_specs
from engine.architectures.vision_language import VisionLanguage
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.modules.rope import RopeSpec


class Glm4vMoe(VisionLanguage, Glm4Moe):
    hf_names = ("Glm4vMoeForConditionalGeneration",)
    vision = "engine.vision.glm4v:Glm4vVision"

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        spec = super().attention(cfg, layer_type, rope)
        return replace(spec, qkv_bias=bool(cfg.get("attention_bias", True)), qk_norm=False)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        return glm_mrope_specs(super().rope_specs(cfg))
