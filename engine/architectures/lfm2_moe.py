"""LFM2-MoE (Liquid AI): LFM2 whose feed-forwards after the first ``num_dense_layers`` are
mixtures of experts. Its router scores each expert with a sigmoid, chooses by the scores plus a
learned ``expert_bias`` (kept beside the router, for the choice only), renormalises the chosen
experts' weights and scales them by ``routed_scaling_factor``; the experts are SwiGLU MLPs named
``w1`` / ``w3`` / ``w2`` like the dense ones. Its dense MLPs are ``intermediate_size`` wide as
configured (no LFM2 width adjustment)."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.lfm2 import LFM2_NAMES, Lfm2
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.gated_mlp import GatedMLPSpec
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.layers.spec import ModelSpec

EXPERTS = SparseMoENames(
    router="feed_forward.gate",
    selection_bias="feed_forward.expert_bias",
    expert_gate="feed_forward.experts.{e}.w1",
    expert_up="feed_forward.experts.{e}.w3",
    expert_down="feed_forward.experts.{e}.w2",
    experts_fused="feed_forward.experts",
)


class Lfm2Moe(Lfm2):
    hf_names = ("Lfm2MoeForCausalLM",)
    names = replace(LFM2_NAMES, parts=(*LFM2_NAMES.parts, EXPERTS))

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)
        experts = int(cfg.require("num_experts"))
        top_k = int(cfg.require("num_experts_per_tok"))
        if not 1 <= top_k <= experts:
            raise ModelLoadError(
                f"{cfg.directory / 'config.json'}: num_experts_per_tok is {top_k}, "
                f"but the model has {experts} experts"
            )
        moe = SparseMoESpec(
            num_experts=experts,
            experts_per_token=top_k,
            intermediate_size=int(cfg.require("moe_intermediate_size")),
            normalize=bool(cfg.get("norm_topk_prob", True)),
            scoring="sigmoid",
            selection_bias=bool(cfg.get("use_expert_bias", True)),
            routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        )
        dense = int(cfg.get("num_dense_layers", 2))
        layers = tuple(
            layer if i < dense else replace(layer, feed_forward=moe) for i, layer in enumerate(spec.layers)
        )
        return replace(spec, layers=layers)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        raise ModelLoadError(f"{cfg.directory / 'config.json'}: LFM2-MoE needs 'layer_types'")

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        return GatedMLPSpec(int(cfg.require("intermediate_size")), "silu")
