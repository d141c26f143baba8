"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): Qwen3-VL's decoder and deepstack vision tower
with Qwen3-MoE's mixtures of experts (softmax router, weights renormalised over the chosen
experts; dense MLPs where ``mlp_only_layers`` or ``decoder_sparse_step`` say). Its checkpoints
store each layer's experts fused (``mlp.experts.gate_up_proj`` / ``down_proj``), transposed in
Qwen's own ones: ``engine.layers.sparse_moe`` reads either."""

from engine.architectures.base import ModelSpec, mixture_of_experts
from engine.architectures.qwen3_vl import Qwen3VL
from engine.config import ModelConfig


class Qwen3VLMoe(Qwen3VL):
    hf_names = ("Qwen3VLMoeForConditionalGeneration",)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=True)
