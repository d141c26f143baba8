"""Command R (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM): each layer's attention
and MLP both read one LayerNorm of the stream (mean-subtracting, a scale and no bias) and their
outputs join it together; the logits are multiplied by ``logit_scale``; RoPE rotates adjacent
pairs of dimensions; the head is tied by default. Command R+ normalises queries and keys per head
with a LayerNorm whose scale differs from head to head (``use_qk_norm``). Cohere 2 slides three
layers in four (``layer_types``, or every ``sliding_window_pattern``-th layer global), and only
its sliding layers rotate: the global ones use no positions at all (NoPE)."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import FULL, SLIDING, Architecture
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec


class Cohere(Architecture):
    hf_names = ("CohereForCausalLM",)
    default_tie = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)
        return replace(
            spec,
            layers=tuple(replace(layer, parallel=True) for layer in spec.layers),
            layer_norm=True,
            norm_eps=float(cfg.get("layer_norm_eps") or 1e-5),
            logit_scale=float(cfg.get("logit_scale") or 1.0),
        )

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        qk_norm = bool(cfg.get("use_qk_norm", False))
        return replace(super().attention(cfg, layer_type, rope), qk_norm=qk_norm, qk_norm_head_scales=qk_norm)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        return {kind: replace(spec, adjacent_pairs=True) for kind, spec in super().rope_specs(cfg).items()}


class Cohere2(Cohere):
    hf_names = ("Cohere2ForCausalLM",)

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        # Cohere 2's heads are always hidden_size / num_attention_heads wide, and never normalised.
        head_dim = int(cfg.require("hidden_size")) // int(cfg.require("num_attention_heads"))
        spec = super().attention(cfg, layer_type, rope)
        return replace(
            spec, head_dim=head_dim, scale=head_dim**-0.5, qk_norm=False, qk_norm_head_scales=False
        )

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        pattern = int(cfg.get("sliding_window_pattern") or 4)
        return [
            FULL if (i + 1) % pattern == 0 else SLIDING for i in range(int(cfg.require("num_hidden_layers")))
        ]

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        return [kind == SLIDING for kind in cfg.get("layer_types") or self.layer_types(cfg)]
