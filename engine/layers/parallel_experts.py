"""A dense MLP beside a mixture of experts as one feed-forward kind (Gemma 4's 26B-A4B): its spec
(the two parts' own specs), where checkpoints keep its weights, and how they become a
:class:`~engine.modules.parallel_experts.ParallelExperts`. The kind reads the residual stream as
it is (``reads_residual``): each part has its own pre-norm, the router none but its own scaling
(:class:`~engine.modules.scaled_router.ScaledRouter`), and each chosen expert's weight is
multiplied by a learned per-expert scale."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.layers.gated_mlp import GatedMLPNames, GatedMLPSpec, build_gated_mlp
from engine.layers.kind import FeedForwardKind
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec, build_sparse_moe
from engine.layers.spec import FeedForwardSpec
from engine.modules.moe import SparseMoE
from engine.modules.parallel_experts import ParallelExperts
from engine.modules.scaled_router import ScaledRouter

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class ParallelExpertsSpec(FeedForwardSpec):
    kind: ClassVar[str] = "parallel_experts"
    reads_residual: ClassVar[bool] = True

    mlp: GatedMLPSpec
    moe: SparseMoESpec


def _gemma4_experts() -> SparseMoENames:
    return SparseMoENames(
        router="router.proj",
        experts_fused="experts",
        expert_gate="experts.{e}.gate_proj",
        expert_up="experts.{e}.up_proj",
        expert_down="experts.{e}.down_proj",
    )


@dataclass(frozen=True)
class ParallelExpertsNames:
    kind: ClassVar[str] = "parallel_experts"

    mlp: GatedMLPNames = field(default_factory=GatedMLPNames)
    mlp_norm: str = "pre_feedforward_layernorm"
    mlp_out_norm: str = "post_feedforward_layernorm_1"
    moe: SparseMoENames = field(default_factory=_gemma4_experts)
    moe_norm: str = "pre_feedforward_layernorm_2"
    moe_out_norm: str = "post_feedforward_layernorm_2"
    router_scale: str = "router.scale"
    expert_scale: str = "router.per_expert_scale"


def build_parallel_experts(
    reader: LayerReader, spec: ParallelExpertsSpec, names: ParallelExpertsNames
) -> ParallelExperts:
    h, moe = reader.hidden_size, spec.moe
    mlp_norm = reader.norm(names.mlp_norm, h)
    mlp = build_gated_mlp(reader, spec.mlp, names.mlp)
    mlp_out_norm = reader.norm(names.mlp_out_norm, h)
    # The router's linear and the experts as the sparse MoE kind reads them (fused or one each).
    plain = build_sparse_moe(reader, moe, names.moe)
    router = ScaledRouter(reader.unscaled_norm(h), reader.tensor(names.router_scale, [h]), plain.router)
    experts = SparseMoE(
        router,
        list(plain.experts),
        moe.experts_per_token,
        moe.normalize,
        scoring=moe.scoring,
        expert_norm=reader.norm(names.moe_norm, h),
        expert_scale=reader.tensor(names.expert_scale, [moe.num_experts], torch.float32),
    )
    return ParallelExperts(mlp_norm, mlp, mlp_out_norm, experts, reader.norm(names.moe_out_norm, h))


PARALLEL_EXPERTS = FeedForwardKind(ParallelExpertsNames(), build_parallel_experts)
