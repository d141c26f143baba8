"""GLM-4 (Glm4ForCausalLM, GLM-4-0414): Llama with sandwich norms around both sub-layers (each
output normalised again before it joins the stream: ``post_self_attn_layernorm`` and
``post_mlp_layernorm``), q/k/v biases (``attention_bias``; never one on o_proj), gate and up
fused in one ``gate_up_proj``, and RoPE on part of each head (half where the config does not
say) rotating adjacent pairs of dimensions."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import Architecture, TensorNames
from engine.architectures.glm4_moe import states_partial_rotary
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.gated_mlp import GatedMLPNames
from engine.modules.rope import RopeSpec

_NAMES = TensorNames(
    mixer_out_norm="post_self_attn_layernorm",
    feed_forward_norm="post_attention_layernorm",
    feed_forward_out_norm="post_mlp_layernorm",
    parts=(GatedMLPNames(gate_up_fused="mlp.gate_up_proj"),),
)


class Glm4(Architecture):
    hf_names = ("Glm4ForCausalLM",)
    names = _NAMES
    sandwich_norms = True

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        return replace(super().attention(cfg, layer_type, rope), o_bias=False)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        partial = {} if states_partial_rotary(cfg) else {"partial_rotary_factor": 0.5}
        return {k: replace(s, adjacent_pairs=True, **partial) for k, s in super().rope_specs(cfg).items()}
