"""MiniMax-M2 (MiniMaxM2ForCausalLM): every layer full attention, with one RMSNorm over all the
queries and one over all the keys (not per head) and RoPE on the first ``rotary_dim`` dimensions
of each head, then a mixture of experts in every layer: a sigmoid score per expert, the experts
chosen by the scores plus ``e_score_correction_bias``, weighted by their renormalised scores, no
shared expert. The Hub's checkpoints keep the block as Mixtral's (``block_sparse_moe``, experts
``w1``/``w3``/``w2``, each ``intermediate_size`` wide), the bias beside the router."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.architectures.base import FULL, Architecture, TensorNames
from engine.architectures.expert_layers import with_experts
from engine.architectures.glm4_moe import states_partial_rotary
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec

HUB_EXPERTS = SparseMoENames(
    router="block_sparse_moe.gate",
    selection_bias="block_sparse_moe.e_score_correction_bias",
    expert_gate="block_sparse_moe.experts.{e}.w1",
    expert_up="block_sparse_moe.experts.{e}.w3",
    expert_down="block_sparse_moe.experts.{e}.w2",
    experts_fused="block_sparse_moe.experts",
)
# transformers 5's in-memory layout (a checkpoint saved without the conversion back)
IN_MEMORY_EXPERTS = SparseMoENames(selection_bias="mlp.e_score_correction_bias")


class MiniMaxM2(Architecture):
    hf_names = ("MiniMaxM2ForCausalLM",)
    names = TensorNames(parts=(HUB_EXPERTS,))
    qkv_bias = False

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        return [FULL] * int(cfg.require("num_hidden_layers"))  # no window, whatever the config holds

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        spec = super().attention(cfg, layer_type, rope)
        return replace(spec, qk_norm=True, qk_norm_across_heads=True)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        """The released configs give the rotated part as ``rotary_dim`` dimensions per head."""
        specs = super().rope_specs(cfg)
        rotary_dim = cfg.get("rotary_dim")
        if rotary_dim is None or states_partial_rotary(cfg):
            return specs
        head_dim = int(
            cfg.get("head_dim") or int(cfg.require("hidden_size")) // int(cfg.require("num_attention_heads"))
        )
        factor = int(rotary_dim) / head_dim
        return {kind: replace(spec, partial_rotary_factor=factor) for kind, spec in specs.items()}

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        moe = SparseMoESpec(
            num_experts=int(cfg.get("num_local_experts") or cfg.require("num_experts")),
            experts_per_token=int(cfg.require("num_experts_per_tok")),
            intermediate_size=int(cfg.require("intermediate_size")),
            normalize=True,
            activation=cfg.get("hidden_act") or "silu",
            scoring="sigmoid",
            selection_bias=True,
        )
        return with_experts(super().spec(cfg), cfg, moe, lambda i: True)

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        if has(f"{self.names.prefix}layers.0.{HUB_EXPERTS.router}.weight"):
            return self.names
        return TensorNames(parts=(IN_MEMORY_EXPERTS,))
