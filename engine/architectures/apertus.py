"""Apertus (ApertusForCausalLM): Llama with q/k RMSNorm per head, an MLP without a gate whose
activation is xIELU with learned curvatures per layer (``mlp.act_fn.alpha_p``/``alpha_n``), and
its pre-norms named ``attention_layernorm`` and ``feedforward_layernorm``."""

from __future__ import annotations

from engine.architectures.base import Architecture, TensorNames
from engine.config import ModelConfig
from engine.layers.plain_mlp import PlainMLPSpec


class Apertus(Architecture):
    hf_names = ("ApertusForCausalLM",)
    names = TensorNames(mixer_norm="attention_layernorm", feed_forward_norm="feedforward_layernorm")
    qk_norm = True

    def mlp(self, cfg: ModelConfig) -> PlainMLPSpec:
        activation = cfg.get("hidden_act") or "xielu"
        return PlainMLPSpec(intermediate_size=int(cfg.require("intermediate_size")), activation=activation)
