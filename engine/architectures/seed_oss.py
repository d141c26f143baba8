"""Seed-OSS (SeedOssForCausalLM): Llama whose q/k/v and o projections take their biases from two
fields, ``attention_bias`` and ``attention_out_bias``."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import Architecture
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.modules.rope import RopeSpec


class SeedOss(Architecture):
    hf_names = ("SeedOssForCausalLM",)

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        spec = super().attention(cfg, layer_type, rope)
        return replace(spec, o_bias=bool(cfg.get("attention_out_bias", False)))
