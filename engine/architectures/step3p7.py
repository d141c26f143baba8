"""Step 3.5 and Step 3.7 (StepFun): the text decoder, as transformers' ``step3p7`` defines it (its
``Step3p7TextConfig`` is the model type ``step3p5`` of the Step 3.5 checkpoints too). Step 3.7's
vision tower is not read: its checkpoints run as text models.

What differs from the common reading:

- norms scale by ``1 + weight`` (zero-centred), q/k norms per head included;
- sliding-window layers may have more query heads than full ones (``per_layer_config``, or the
  Hub configs' ``num_sliding_attention_heads`` / ``attention_other_setting``), and each layer's
  heads are gated by a sigmoid of ``g_proj``, one gate per head;
- RoPE per layer type (``rope_parameters``; the Hub configs' per-layer ``rope_theta`` and
  ``partial_rotary_factors`` are read as transformers reads them: the first layer of each type
  gives that type's, and ``rope_scaling`` applies to the full-attention layers);
- the layers of ``mlp_layer_types`` "sparse" (the Hub configs' ``moe_layers_enum``; by default all
  but the first three) are mixtures of experts: sigmoid router with a selection bias
  (``moe.router_bias``), renormalised weights times ``moe_router_scaling_factor``, experts stacked
  per projection under ``moe.``, and an ungated shared expert (``share_expert``);
- SwiGLUs clamped per layer: ``swiglu_limits`` for the routed experts, ``swiglu_limits_shared``
  for the shared expert and the dense MLP (0 or null: none).

The Hub configs pad their per-layer lists with the multi-token-prediction layers
(``num_nextn_predict_layers``), which are not run: only the first ``num_hidden_layers`` count.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.architectures.base import FULL, Architecture, TensorNames, _rope_from_params
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionNames, AttentionSpec
from engine.layers.gated_mlp import GatedMLPSpec
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec

EXPERTS = SparseMoENames(
    router="moe.gate",
    selection_bias="moe.router_bias",
    expert_gate="moe.experts.{e}.gate_proj",
    expert_up="moe.experts.{e}.up_proj",
    expert_down="moe.experts.{e}.down_proj",
    experts_stacked="moe",
    shared_expert="share_expert",
)
ATTENTION = AttentionNames(gate="self_attn.g_proj")
# The attention settings a layer may have of its own: AttentionSpec's field -> its key in
# per_layer_config, and in the Hub configs' attention_other_setting.
_LAYER_FIELDS = {
    "num_heads": ("num_attention_heads", "num_attention_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_attention_groups"),
    "head_dim": ("head_dim", "head_dim"),
}


class Step3p7(Architecture):
    hf_names = ("Step3p5ForCausalLM", "Step3p7ForConditionalGeneration")
    names = TensorNames(parts=(ATTENTION, EXPERTS))
    qk_norm = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        for unsupported in ("use_bidirectional_attention", "sink"):
            if cfg.get(unsupported):
                raise ModelLoadError(f"{cfg.directory / 'config.json'}: '{unsupported}' is not supported")
        spec = super().spec(cfg)
        types = self._types(cfg, spec.num_layers)
        sparse = _sparse_layers(cfg, spec.num_layers)
        layers = []
        for i, layer in enumerate(spec.layers):
            mixer = replace(layer.mixer, **_layer_attention(cfg, i, types[i]))
            if i in sparse:
                feed_forward = self._experts(cfg, i)
            else:
                feed_forward = replace(layer.feed_forward, limit=_limit(cfg, "swiglu_limits_shared", i))
            layers.append(replace(layer, mixer=mixer, feed_forward=feed_forward))
        norm_offset = 1.0 if cfg.get("zero_centered", True) else 0.0
        return replace(spec, layers=tuple(layers), norm_offset=norm_offset)

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        spec = super().attention(cfg, layer_type, rope)
        kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_groups") or spec.num_heads
        scale = float(cfg.get("query_pre_attn_scalar") or spec.head_dim) ** -0.5
        gate = "per_head" if cfg.get("use_head_wise_attn_gate", True) else None
        return replace(spec, num_kv_heads=int(kv_heads), scale=scale, gate_proj=gate)

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        # Step 3.7's configs name "swigluoai" as hidden_act, but transformers' Step MLPs are
        # SiLU-gated (the clamp is the limits'): SiLU it is.
        return GatedMLPSpec(int(cfg.require("intermediate_size")), "silu", bool(cfg.get("mlp_bias", False)))

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        n = int(cfg.require("num_hidden_layers"))
        listed = cfg.get("use_rope_layers") or []  # the Hub configs' per-layer switch; empty: all
        return [bool(listed[i]) if i < len(listed) else True for i in range(n)]

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and params:
            return super().rope_specs(cfg)
        n = int(cfg.require("num_hidden_layers"))
        types = self._types(cfg, n)
        thetas = _per_layer(cfg.get("rope_theta", 10000.0), n)
        partials = _per_layer(cfg.get("partial_rotary_factors") or 1.0, n)
        scaled = cfg.get("yarn_only_types") or [FULL]
        # rope_scaling's older spelling of its kind is "type"
        scaling = {("rope_type" if k == "type" else k): v for k, v in (cfg.get("rope_scaling") or {}).items()}
        specs = {}
        for kind in dict.fromkeys(types):
            first = types.index(kind)
            params = {"rope_type": "default", "partial_rotary_factor": partials[first]}
            params.update(scaling if kind in scaled else {})
            params["rope_theta"] = thetas[first]
            specs[kind] = _rope_from_params(params, cfg, float(thetas[first]))
        return specs

    def _types(self, cfg: ModelConfig, n: int) -> list[str]:
        return list(cfg.get("layer_types") or self.layer_types(cfg))[:n]

    def _experts(self, cfg: ModelConfig, i: int) -> SparseMoESpec:
        experts = int(
            cfg.get("n_routed_experts") or cfg.get("moe_num_experts") or cfg.require("num_local_experts")
        )
        top_k = int(cfg.get("num_experts_per_tok") or cfg.require("moe_top_k"))
        if not 1 <= top_k <= experts:
            raise ModelLoadError(
                f"{cfg.directory / 'config.json'}: {top_k} experts per token, but the model has {experts}"
            )
        return SparseMoESpec(
            num_experts=experts,
            experts_per_token=top_k,
            intermediate_size=int(cfg.require("moe_intermediate_size")),
            normalize=bool(cfg.get("norm_expert_weight", True)),
            scoring=cfg.get("moe_router_activation", "sigmoid"),
            selection_bias=bool(cfg.get("use_moe_router_bias", True)),
            routed_scale=float(cfg.get("moe_router_scaling_factor", 1.0)),
            shared_expert_size=int(cfg.require("share_expert_dim")),
            shared_expert_gate=False,
            shared_expert_bias=bool(cfg.get("mlp_bias", False)),  # an MLP like the dense ones
            limit=_limit(cfg, "swiglu_limits", i),
            shared_expert_limit=_limit(cfg, "swiglu_limits_shared", i),
        )


def _layer_attention(cfg: ModelConfig, i: int, layer_type: str) -> dict[str, int]:
    """Layer ``i``'s own head count, KV heads or head size where they differ from the model's:
    transformers' ``per_layer_config`` (keyed by the layer's index), else the Hub configs'
    settings for the sliding-window layers."""
    overrides = cfg.get("per_layer_config")
    if isinstance(overrides, dict):
        own = overrides.get(str(i)) or overrides.get(i) or {}
        found = {field: own.get(key) for field, (key, _) in _LAYER_FIELDS.items()}
    elif layer_type == "sliding_attention":
        other = cfg.get("attention_other_setting") or {}
        found = {field: other.get(key) for field, (_, key) in _LAYER_FIELDS.items()}
        found["num_heads"] = cfg.get("num_sliding_attention_heads") or found["num_heads"]
    else:
        return {}
    return {field: int(value) for field, value in found.items() if value}


def _sparse_layers(cfg: ModelConfig, n: int) -> set[int]:
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        return {i for i in range(n) if kinds[i] == "sparse"}
    listed = cfg.get("moe_layers_enum")  # "3,4,5,..." or a list
    if listed is None:
        return set(range(3, n))
    items = listed.split(",") if isinstance(listed, str) else listed
    return {int(item) for item in items if str(item).strip()} & set(range(n))


def _limit(cfg: ModelConfig, key: str, i: int) -> float | None:
    limits = cfg.get(key) or []
    value = limits[i] if i < len(limits) else None
    return float(value) if value else None


def _per_layer(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * n
