"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's post-norm layers (``h += norm(attention(h))``,
``h += norm(mlp(h))``) whose q/k RMSNorm spans the whole projection (all heads at once), and three
sliding layers per global one unless ``layer_types`` says otherwise. Both kinds rotate whole
heads; a transformers 4 config's ``rope_scaling`` applies to the global layers only, the sliding
ones keep the plain rotation at the same base."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import FULL, POST_NORMS, SLIDING, Architecture, post_norms
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec


class Olmo3(Architecture):
    hf_names = ("Olmo3ForCausalLM",)
    names = POST_NORMS
    qk_norm = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return post_norms(super().spec(cfg))

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        return replace(super().attention(cfg, layer_type, rope), qk_norm_across_heads=True)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        return [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(int(cfg.require("num_hidden_layers")))]

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        specs = {k: replace(s, partial_rotary_factor=1.0) for k, s in super().rope_specs(cfg).items()}
        params = cfg.get("rope_parameters")
        if not (isinstance(params, dict) and SLIDING in params):  # transformers 4: scaling is global-only
            specs[SLIDING] = replace(specs[FULL], kind="default", params={})
        return specs
