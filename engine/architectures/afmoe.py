"""AFMoE (Arcee's Trinity): attention in layers that alternate between sliding windows and, every
``global_attn_every_n_layers``-th layer, full attention; only the sliding layers rotate (the full
ones have no positional encoding). Queries and keys are normed per head and the heads' outputs
pass through a sigmoid gate of their own projection (``self_attn.gate_proj``, one gate per
feature). Each sub-layer has a norm before and after it (``pre_mlp_layernorm`` /
``post_mlp_layernorm`` around the feed-forward). After the first ``num_dense_layers`` dense MLPs
come mixtures of experts: a sigmoid router whose ``expert_bias`` steers the choice only, weights
renormalised and scaled by ``route_scale``, and ``num_shared_experts`` experts' worth of one
ungated shared expert. With ``mup_enabled`` the embeddings are scaled by sqrt(hidden)."""

from __future__ import annotations

import math
from dataclasses import replace

from engine.architectures.base import FULL, SLIDING, Architecture, TensorNames
from engine.architectures.expert_layers import with_experts
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec

EXPERTS = SparseMoENames(
    router="mlp.router.gate", selection_bias="mlp.expert_bias", shared_expert="mlp.shared_experts"
)


class Afmoe(Architecture):
    hf_names = ("AfmoeForCausalLM",)
    names = TensorNames(
        mixer_out_norm="post_attention_layernorm",
        feed_forward_norm="pre_mlp_layernorm",
        feed_forward_out_norm="post_mlp_layernorm",
        parts=(EXPERTS,),
    )
    qk_norm = True
    sandwich_norms = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)
        if cfg.get("mup_enabled", False):
            spec = replace(spec, embed_scale=math.sqrt(spec.hidden_size))
        width = int(cfg.require("moe_intermediate_size"))
        moe = SparseMoESpec(
            num_experts=int(cfg.require("num_experts")),
            experts_per_token=int(cfg.require("num_experts_per_tok")),
            intermediate_size=width,
            # transformers fixes these; Arcee's own configs may spell them out
            normalize=bool(cfg.get("route_norm", True)),
            scoring=cfg.get("score_func", "sigmoid"),
            selection_bias=True,
            routed_scale=float(cfg.get("route_scale", 1.0)),
            num_groups=int(cfg.get("n_group") or 1),
            groups_per_token=int(cfg.get("topk_group") or 1),
            activation=cfg.get("hidden_act") or "silu",
            shared_expert_size=width * int(cfg.get("num_shared_experts", 2)),
            shared_expert_gate=False,
        )
        dense = int(cfg.get("num_dense_layers", 1))
        return with_experts(spec, cfg, moe, lambda i: i >= dense)

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        return replace(super().attention(cfg, layer_type, rope), gate_proj="per_feature")

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        n, every = int(cfg.require("num_hidden_layers")), int(cfg.get("global_attn_every_n_layers", 4))
        return [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        types = cfg.get("layer_types") or self.layer_types(cfg)
        return [kind == SLIDING for kind in types]
