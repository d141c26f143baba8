"""dots.llm1 (Dots1ForCausalLM): Qwen3's attention (per-head q/k norms; q/k/v/o biases with
``attention_bias``) whose layers from ``first_k_dense_replace`` on are DeepSeek-V3 mixtures of
experts. Without ``layer_types`` in config.json, layers from ``max_window_layers`` on slide
wherever ``sliding_window`` is set, as transformers reads it (``use_sliding_window`` aside)."""

from __future__ import annotations

from engine.architectures.base import FULL, SLIDING, TensorNames
from engine.architectures.deepseek_moe import DEEPSEEK_EXPERTS, deepseek_experts
from engine.architectures.expert_layers import with_experts
from engine.architectures.qwen3 import Qwen3
from engine.config import ModelConfig
from engine.layers.spec import ModelSpec


class Dots1(Qwen3):
    hf_names = ("Dots1ForCausalLM",)
    names = TensorNames(parts=(DEEPSEEK_EXPERTS,))

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        n = int(cfg.require("num_hidden_layers"))
        # 62: transformers' default for max_window_layers (every layer of the released model)
        first = int(cfg.get("max_window_layers", 62)) if cfg.get("sliding_window") else n
        return [SLIDING if i >= first else FULL for i in range(n)]

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        dense = int(cfg.get("first_k_dense_replace", 0))
        moe = deepseek_experts(cfg, normalize=False)
        return with_experts(super().spec(cfg), cfg, moe, lambda i: i >= dense)
