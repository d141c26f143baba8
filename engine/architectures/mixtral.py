"""Mixtral: Mistral (sliding window) whose every MLP is a mixture of experts, stored under
``block_sparse_moe`` with the experts' projections named ``w1`` (gate), ``w3`` (up), ``w2``
(down). Its router always renormalises the chosen experts' probabilities."""

from collections.abc import Callable

from engine.architectures.base import ModelSpec, TensorNames, mixture_of_experts
from engine.architectures.mistral import Mistral
from engine.config import ModelConfig
from engine.layers.sparse_moe import SparseMoENames

BLOCK_SPARSE_MOE = SparseMoENames(
    router="block_sparse_moe.gate",
    expert_gate="block_sparse_moe.experts.{e}.w1",
    expert_up="block_sparse_moe.experts.{e}.w3",
    expert_down="block_sparse_moe.experts.{e}.w2",
)


class Mixtral(Mistral):
    hf_names = ("MixtralForCausalLM",)
    names = TensorNames(parts=(BLOCK_SPARSE_MOE,))

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=True)

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        # Saved from transformers 5's in-memory layout (not converted back), the block sits under
        # ``mlp`` with fused experts, as Qwen-MoE's does.
        if has(f"{self.names.prefix}layers.0.{BLOCK_SPARSE_MOE.router}.weight"):
            return self.names
        return TensorNames()
