"""Qwen3.5-MoE: Qwen3.5 whose every MLP is a mixture of experts with a shared expert (routing
weights always renormalised over the chosen experts), text alone or with Qwen3.5's vision."""

from engine.architectures.base import ModelSpec, mixture_of_experts
from engine.architectures.qwen3_5 import Qwen3_5, Qwen3_5VL
from engine.config import ModelConfig
from engine.layers.gated_mlp import GatedMLPSpec


class _EveryLayerSparse:
    """The configs name no dense MLP width (no layer has one): the experts' width stands in for
    it, so that the common reading can build the layers that :func:`mixture_of_experts` replaces."""

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        width = cfg.get("intermediate_size") or cfg.require("moe_intermediate_size")
        return GatedMLPSpec(intermediate_size=int(width), activation=cfg.get("hidden_act") or "silu")

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=True)


class Qwen3_5Moe(_EveryLayerSparse, Qwen3_5):
    hf_names = ("Qwen3_5MoeForCausalLM",)


class Qwen3_5MoeVL(_EveryLayerSparse, Qwen3_5VL):
    hf_names = ("Qwen3_5MoeForConditionalGeneration",)
