"""Qwen3.5-MoE: Qwen3.5 whose every MLP is a mixture of experts with a shared expert (routing
weights always renormalised over the chosen experts), text alone or with Qwen3.5's vision."""

from engine.architectures.base import ModelSpec, mixture_of_experts
from engine.architectures.qwen3_5 import Qwen3_5, Qwen3_5VL
from engine.config import ModelConfig


class Qwen3_5Moe(Qwen3_5):
    hf_names = ("Qwen3_5MoeForCausalLM",)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=True)


class Qwen3_5MoeVL(Qwen3_5VL):
    hf_names = ("Qwen3_5MoeForConditionalGeneration",)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=True)
