"""Arcee AFM (ArceeForCausalLM): Llama whose MLP has no gate, ``down(relu(up(x))^2)``."""

from __future__ import annotations

from engine.architectures.base import Architecture
from engine.config import ModelConfig
from engine.layers.plain_mlp import PlainMLPSpec


class Arcee(Architecture):
    hf_names = ("ArceeForCausalLM",)

    def mlp(self, cfg: ModelConfig) -> PlainMLPSpec:
        return PlainMLPSpec(
            intermediate_size=int(cfg.require("intermediate_size")),
            activation=cfg.get("hidden_act") or "relu2",
            bias=bool(cfg.get("mlp_bias", False)),
        )
