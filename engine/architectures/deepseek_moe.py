"""DeepSeek-V3's mixture of experts, which GLM-4.5 and dots.llm1 take as it is: a sigmoid score
per expert; the experts chosen by the scores plus ``e_score_correction_bias`` (a bias for the
choice only), among each token's best ``topk_group`` of ``n_group`` groups; weighted by their
scores, renormalised where ``norm_topk_prob`` says, times ``routed_scaling_factor``; and
``n_shared_experts`` shared experts, one ungated SwiGLU MLP of that many experts' width, under
``mlp.shared_experts``."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec

DEEPSEEK_EXPERTS = SparseMoENames(shared_expert="mlp.shared_experts")


def deepseek_experts(cfg: ModelConfig, normalize: bool, shared_experts: int = 0) -> SparseMoESpec:
    """The experts of a DeepSeek-V3-style config; ``normalize`` and ``shared_experts`` are the
    family's defaults for ``norm_topk_prob`` and ``n_shared_experts``."""
    width = int(cfg.require("moe_intermediate_size"))
    return SparseMoESpec(
        num_experts=int(cfg.get("n_routed_experts") or cfg.require("num_local_experts")),
        experts_per_token=int(cfg.require("num_experts_per_tok")),
        intermediate_size=width,
        normalize=bool(cfg.get("norm_topk_prob", normalize)),
        activation=cfg.get("hidden_act") or "silu",
        shared_expert_size=width * int(cfg.get("n_shared_experts", shared_experts)),
        shared_expert_gate=False,
        scoring="sigmoid",
        selection_bias=True,
        routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        num_groups=int(cfg.get("n_group") or 1),
        groups_per_token=int(cfg.get("topk_group") or 1),
    )
