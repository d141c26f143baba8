"""gpt-oss (OpenAI): attention layers alternating sliding-window and full (``layer_types``), each
head with a learned attention sink, q/k/v/o biases and YaRN RoPE; every feed-forward a mixture
of experts.

Its router is a linear with a bias; each token takes the top ``num_experts_per_tok`` logits and
a softmax over those (the same weights as a softmax over all experts renormalised over the
chosen ones, which is how the common MoE reads it). Its experts have biases and a clamped
SwiGLU, ``(clip(up, +-limit) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, limit)``
(``swiglu_limit``; config.json's ``hidden_act`` "silu" does not describe it). transformers keeps
them fused, ``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * f]`` with gate and up columns
alternating and ``down_proj`` ``[experts, f, hidden]``, each with a ``_bias``; the Hub's
checkpoints store both projections in MXFP4, read dequantized (``engine.loading.mxfp4``).
"""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import FULL, SLIDING, Architecture, ModelSpec, TensorNames
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionSpec
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.modules.rope import RopeSpec

GPT_OSS_EXPERTS = SparseMoENames(
    router="mlp.router",
    experts_fused="mlp.experts",
    experts_fused_in_out=True,
    gate_up_interleaved=True,
)
QUICK_GELU_ALPHA = 1.702  # the "quick_gelu" activation's gain


class GptOss(Architecture):
    hf_names = ("GptOssForCausalLM",)
    names = TensorNames(parts=(GPT_OSS_EXPERTS,))

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        where = cfg.directory / "config.json"
        experts = int(cfg.require("num_local_experts"))
        top_k = int(cfg.require("num_experts_per_tok"))
        if not 1 <= top_k <= experts:
            raise ModelLoadError(
                f"{where}: num_experts_per_tok is {top_k}, but the model has {experts} experts"
            )
        alpha = float(cfg.get("swiglu_alpha", QUICK_GELU_ALPHA))
        if alpha != QUICK_GELU_ALPHA:
            raise ModelLoadError(f"{where}: swiglu_alpha {alpha} is not supported (only {QUICK_GELU_ALPHA})")
        moe = SparseMoESpec(
            num_experts=experts,
            experts_per_token=top_k,
            intermediate_size=int(cfg.require("intermediate_size")),
            normalize=True,
            activation="quick_gelu",
            limit=float(cfg.get("swiglu_limit", 7.0)),
            limit_after_act=False,
            up_offset=1.0,
            expert_bias=True,
            router_bias=True,
        )
        spec = super().spec(cfg)
        return replace(spec, layers=tuple(replace(layer, feed_forward=moe) for layer in spec.layers))

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        return replace(super().attention(cfg, layer_type, rope), sinks=True)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        # transformers' default when config.json lists none: sliding first, then alternating
        n = int(cfg.require("num_hidden_layers"))
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
