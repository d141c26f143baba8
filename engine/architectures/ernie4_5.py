"""Ernie 4.5 (Ernie4_5ForCausalLM, the dense sizes): Llama whose RoPE rotates adjacent pairs of
dimensions, with biases on every projection of attention and MLP where ``use_bias`` says, and a
tied head by default."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import Architecture
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.gated_mlp import GatedMLPSpec
from engine.modules.rope import RopeSpec


class Ernie4_5(Architecture):
    hf_names = ("Ernie4_5ForCausalLM",)
    default_tie = True

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        bias = bool(cfg.get("use_bias", False))
        return replace(super().attention(cfg, layer_type, rope), qkv_bias=bias, o_bias=bias)

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        return replace(super().mlp(cfg), bias=bool(cfg.get("use_bias", False)))

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        return {kind: replace(spec, adjacent_pairs=True) for kind, spec in super().rope_specs(cfg).items()}
