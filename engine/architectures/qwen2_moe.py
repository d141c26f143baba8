"""Qwen2-MoE: Qwen2 (q/k/v biases) with mixture-of-experts MLPs (as Qwen3-MoE) plus a shared
expert every token goes through, scaled by a sigmoid gate."""

from engine.architectures.base import ModelSpec, mixture_of_experts
from engine.architectures.qwen2 import Qwen2
from engine.config import ModelConfig


class Qwen2Moe(Qwen2):
    hf_names = ("Qwen2MoeForCausalLM",)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=False)
