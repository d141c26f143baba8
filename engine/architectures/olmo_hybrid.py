"""OLMo-Hybrid (OlmoHybridForCausalLM): gated delta nets (``linear_attention`` layers, pre-norm,
with negative eigenvalues allowed: ``beta`` in (0, 2)) beside OLMo 3's attention layers, which are
post-norm (``h += norm(attention(h))``, ``h += norm(mlp(h))``) and normalise queries and keys
across all heads at once. The released checkpoints use no RoPE; a config with a ``rope_theta``
rotates the attention layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.architectures.base import Architecture, ModelSpec, TensorNames
from engine.architectures.qwen3_next import LINEAR, linear_attention
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.gated_delta_net import GatedDeltaNetNames
from engine.layers.spec import MixerSpec
from engine.modules.rope import RopeSpec

_DELTA_NET = GatedDeltaNetNames(
    qkv_parts=("linear_attn.q_proj", "linear_attn.k_proj", "linear_attn.v_proj"),
    z="linear_attn.g_proj",
    b="linear_attn.b_proj",
    a="linear_attn.a_proj",
    conv_parts=("linear_attn.q_conv1d", "linear_attn.k_conv1d", "linear_attn.v_conv1d"),
    norm="linear_attn.o_norm",
    out_proj="linear_attn.o_proj",
)

# A delta-net layer reads its pre-norms, an attention layer its output norms; "post_attention"
# is the one or the other by the layer's kind.
_NAMES = TensorNames(
    mixer_norm="input_layernorm",
    feed_forward_norm="post_attention_layernorm",
    mixer_out_norm="post_attention_layernorm",
    feed_forward_out_norm="post_feedforward_layernorm",
    parts=(_DELTA_NET,),
)

# How many layers to look through for a norm's name: the default layout has an attention layer
# every fourth one, so eight hold both kinds.
_PROBED_LAYERS = 8


class OlmoHybrid(Architecture):
    hf_names = ("OlmoHybridForCausalLM",)
    names = _NAMES
    qk_norm = True

    def mixer(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> MixerSpec:
        if layer_type == LINEAR:
            beta_scale = 2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0
            # The gated output norm's epsilon is fixed (FLA's default), not rms_norm_eps.
            return linear_attention(cfg, beta_scale=beta_scale, norm_eps=1e-5)
        return replace(self.attention(cfg, layer_type, rope), qk_norm_across_heads=True)

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        params = cfg.get("rope_parameters") or {}
        return [params.get("rope_theta") is not None] * int(cfg.require("num_hidden_layers"))

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        # OLMo rotates whole heads: its reference reads no partial_rotary_factor.
        return {k: replace(s, partial_rotary_factor=1.0) for k, s in super().rope_specs(cfg).items()}

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)

        def post_norm(layer):
            if isinstance(layer.mixer, AttentionSpec):
                return replace(layer, pre_norms=False, sandwich_norms=True)
            return layer

        return replace(spec, layers=tuple(map(post_norm, spec.layers)))

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        """Checkpoints written by transformers (and OLMo-core's) call a delta-net layer's norms
        ``attention_layer_norm`` and ``feedforward_layer_norm``, and may call an attention
        layer's post-attention norm ``feedforward_layer_norm`` too."""
        layer = self.names.prefix + self.names.layer

        def found(name: str) -> bool:
            return any(has(f"{layer.format(i=i)}{name}.weight") for i in range(_PROBED_LAYERS))

        names = self.names
        if found("attention_layer_norm"):
            names = replace(
                names, mixer_norm="attention_layer_norm", feed_forward_norm="feedforward_layer_norm"
            )
        if found("post_feedforward_layernorm") and not found("post_attention_layernorm"):
            names = replace(names, mixer_out_norm="feedforward_layer_norm")
        return names
