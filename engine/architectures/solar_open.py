"""Upstage Solar Open (SolarOpenForCausalLM): GLM-4.5's mixture of experts (DeepSeek-V3's sigmoid
router with a selection bias, groups, ``routed_scaling_factor`` and one shared expert) in every
layer, behind Llama's attention: q/k/v biases as ``attention_bias`` says but none on o_proj, no
q/k norms and RoPE over the whole head unless the config gives ``partial_rotary_factor``. There
is no dense MLP, so the config has no ``intermediate_size``."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import Architecture
from engine.architectures.deepseek_moe import deepseek_experts
from engine.architectures.expert_layers import with_experts
from engine.architectures.glm4_moe import Glm4Moe
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.gated_mlp import GatedMLPSpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec


class SolarOpen(Glm4Moe):
    hf_names = ("SolarOpenForCausalLM",)

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        return replace(Architecture.attention(self, cfg, layer_type, rope), o_bias=False)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        return Architecture.rope_specs(self, cfg)

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        # Every layer's feed-forward is replaced by the experts below: this is only a placeholder.
        return GatedMLPSpec(int(cfg.require("moe_intermediate_size")), cfg.get("hidden_act") or "silu")

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        moe = deepseek_experts(cfg, normalize=True, shared_experts=1)
        return with_experts(Architecture.spec(self, cfg), cfg, moe, lambda i: True)
