"""Qwen3-MoE: Qwen3 (q/k norms) whose MLPs are mixtures of experts, except the layers in
``mlp_only_layers`` or between ``decoder_sparse_step`` strides, which keep a dense MLP."""

from engine.architectures.base import ModelSpec, mixture_of_experts
from engine.architectures.qwen3 import Qwen3
from engine.config import ModelConfig


class Qwen3Moe(Qwen3):
    hf_names = ("Qwen3MoeForCausalLM",)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=False)
