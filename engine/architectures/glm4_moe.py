"""GLM-4.5 / 4.6 / 4.5-Air (Glm4MoeForCausalLM): attention with q/k/v biases (``attention_bias``;
never one on o_proj), optional per-head q/k norms (``use_qk_norm``) and RoPE on part of each head
(``partial_rotary_factor``, half where the config does not say); the first
``first_k_dense_replace`` layers keep a dense MLP and the others are DeepSeek-V3 mixtures of
experts. The multi-token-prediction layers stored after the last one (DeepSeek-V3's layout) are
read only by the MTP drafter (``--draft mtp``)."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import Architecture, TensorNames
from engine.architectures.deepseek_moe import DEEPSEEK_EXPERTS, deepseek_experts
from engine.architectures.expert_layers import with_experts
from engine.architectures.mtp_names import DEEPSEEK_MTP
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec


def states_partial_rotary(cfg: ModelConfig) -> bool:
    """Whether config.json gives ``partial_rotary_factor`` (top level or with the RoPE settings)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return cfg.get("partial_rotary_factor") is not None or "partial_rotary_factor" in params


class Glm4Moe(Architecture):
    hf_names = ("Glm4MoeForCausalLM",)
    names = TensorNames(parts=(DEEPSEEK_EXPERTS,))
    mtp = DEEPSEEK_MTP

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        spec = super().attention(cfg, layer_type, rope)
        return replace(spec, o_bias=False, qk_norm=bool(cfg.get("use_qk_norm", False)))

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        specs = super().rope_specs(cfg)
        if states_partial_rotary(cfg):
            return specs
        return {kind: replace(spec, partial_rotary_factor=0.5) for kind, spec in specs.items()}

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        dense = int(cfg.get("first_k_dense_replace", 1))
        moe = deepseek_experts(cfg, normalize=True, shared_experts=1)
        return with_experts(super().spec(cfg), cfg, moe, lambda i: i >= dense)
