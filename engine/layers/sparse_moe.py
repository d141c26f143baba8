"""The sparse mixture of experts as a feed-forward kind: its spec (every family's routing as data),
where checkpoints keep its router and experts, and how they become a
:class:`~engine.modules.moe.SparseMoE`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.layers.gated_mlp import GatedMLPNames
from engine.layers.kind import FeedForwardKind
from engine.layers.spec import FeedForwardSpec
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class SparseMoESpec(FeedForwardSpec):
    """A mixture of experts (the config fields of the families in parentheses).

    Experts:
      ``num_experts`` (num_experts, num_local_experts, n_routed_experts); ``experts_per_token``
      (num_experts_per_tok); ``intermediate_size``: each routed expert's width
      (moe_intermediate_size); ``gated``: an expert is ``down(act(gate(x)) * up(x))`` (SwiGLU),
      else ``down(act(up(x)))`` with only up and down projections (NemotronH);
      ``activation`` (hidden_act; NemotronH's mlp_hidden_act "relu2"); ``latent_size``: the
      routed experts work in this width, between a projection in and one out (NemotronH's
      moe_latent_size; 0: none).
    Router:
      ``scoring``: "softmax" over the experts (Mixtral, Qwen-MoE) or "sigmoid" per expert
      (DeepSeek-V3, GLM-4.5, LFM2-MoE, NemotronH); ``selection_bias``: a learned per-expert bias
      added to the scores to choose the experts, not to weigh them (LFM2-MoE's ``expert_bias``
      with use_expert_bias, ``e_score_correction_bias`` elsewhere); ``normalize``: the chosen
      experts' weights renormalised to sum to one (norm_topk_prob); ``routed_scale``: the
      weights' final factor (routed_scaling_factor); ``num_groups`` / ``groups_per_token``:
      each token chooses among the experts of its best groups only (n_group / topk_group).
    Shared expert:
      ``shared_expert_size``: the width of an expert every token goes through, gated or not as
      the routed ones are (shared_expert_intermediate_size, moe_shared_expert_intermediate_size,
      or n_shared_experts * moe_intermediate_size; 0: none); ``shared_expert_gate``: its output
      is scaled by ``sigmoid(linear(x))`` (Qwen2-MoE's shared_expert_gate).
    """

    kind: ClassVar[str] = "sparse_moe"

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    normalize: bool = False
    activation: str = "silu"
    shared_expert_size: int = 0
    shared_expert_gate: bool = True
    gated: bool = True
    scoring: str = "softmax"
    selection_bias: bool = False
    routed_scale: float = 1.0
    num_groups: int = 1
    groups_per_token: int = 1
    latent_size: int = 0


@dataclass(frozen=True)
class SparseMoENames:
    """The router, each expert's projections as the Hub checkpoints store them (``{e}`` = expert
    index), and the fused 3-D tensors that transformers 5 keeps in memory, under
    ``experts_fused``: ``gate_up_proj`` [experts, 2 * f, hidden] and ``down_proj`` [experts,
    hidden, f] of gated experts, ``up_proj`` [experts, f, hidden] and ``down_proj`` of others."""

    kind: ClassVar[str] = "sparse_moe"

    router: str = "mlp.gate"
    selection_bias: str = "mlp.gate.e_score_correction_bias"
    expert_gate: str = "mlp.experts.{e}.gate_proj"
    expert_up: str = "mlp.experts.{e}.up_proj"
    expert_down: str = "mlp.experts.{e}.down_proj"
    experts_fused: str = "mlp.experts"
    shared_expert: str = "mlp.shared_expert"  # gate_proj (if gated), up_proj, down_proj
    shared_expert_gate: str = "mlp.shared_expert_gate"
    latent_in: str = "mlp.fc1_latent_proj"
    latent_out: str = "mlp.fc2_latent_proj"

    def expert(self, e: int) -> GatedMLPNames:
        return GatedMLPNames(
            self.expert_gate.format(e=e), self.expert_up.format(e=e), None, self.expert_down.format(e=e)
        )


def build_sparse_moe(reader: LayerReader, spec: SparseMoESpec, names: SparseMoENames) -> SparseMoE:
    h = reader.hidden_size
    d = spec.latent_size or h  # the width the routed experts read and write
    latent_in = latent_out = None
    if spec.latent_size:
        latent_in = reader.linear(names.latent_in, h, d)
        latent_out = reader.linear(names.latent_out, d, h)
    shared = shared_gate = None
    if spec.shared_expert_size:
        k = names.shared_expert
        shared_names = GatedMLPNames(f"{k}.gate_proj", f"{k}.up_proj", None, f"{k}.down_proj")
        shared = _expert(reader, spec, shared_names, spec.shared_expert_size, h)
        if spec.shared_expert_gate:
            shared_gate = reader.linear(names.shared_expert_gate, h, 1)
    # Float32 whatever the model's dtype (transformers keeps DeepSeek's and NemotronH's so): the
    # bias only decides which experts win, and rounded to bf16 it can reorder close scores.
    bias = None
    if spec.selection_bias:
        bias = reader.tensor(names.selection_bias, [spec.num_experts], torch.float32)
    return SparseMoE(
        reader.linear(names.router, h, spec.num_experts),
        _routed_experts(reader, spec, names, d),
        spec.experts_per_token,
        spec.normalize,
        shared,
        shared_gate,
        scoring=spec.scoring,
        selection_bias=bias,
        scale=spec.routed_scale,
        num_groups=spec.num_groups,
        groups_per_token=spec.groups_per_token,
        latent_in=latent_in,
        latent_out=latent_out,
    )


def _routed_experts(
    reader: LayerReader, spec: SparseMoESpec, names: SparseMoENames, d: int
) -> list[nn.Module]:
    """Experts stored one linear each (the Hub's layout, and every EXL3 conversion's) are read as
    such; otherwise the fused 3-D tensors of transformers 5 are sliced per expert (views: no
    copy), each slice keyed as the expert's own linear would be."""
    f, count, fused = spec.intermediate_size, spec.num_experts, names.experts_fused
    first = names.expert(0)
    stacked = f"{fused}.gate_up_proj" if spec.gated else f"{fused}.up_proj"
    if reader.has_linear(first.gate if spec.gated else first.up) or not reader.has(stacked):
        return [_expert(reader, spec, names.expert(e), f, d) for e in range(count)]
    ins = reader.packed_tensor(stacked, [count, 2 * f if spec.gated else f, d])
    down = reader.packed_tensor(f"{fused}.down_proj", [count, d, f])
    return [_sliced_expert(reader, spec, names.expert(e), ins[e], down[e]) for e in range(count)]


def _expert(reader: LayerReader, spec: SparseMoESpec, names: GatedMLPNames, f: int, d: int) -> nn.Module:
    """One expert of width ``f`` over ``d`` features: a gated MLP, or up and down only."""
    if spec.gated:
        gate_up = reader.projections([names.gate, names.up], d, [f, f])
        return GatedMLP(gate_up, reader.linear(names.down, f, d), spec.activation)
    return FeedForward(reader.linear(names.up, d, f), reader.linear(names.down, f, d), spec.activation)


def _sliced_expert(
    reader: LayerReader, spec: SparseMoESpec, names: GatedMLPNames, ins: torch.Tensor, down: torch.Tensor
) -> nn.Module:
    f = down.shape[1]
    down_linear = DenseLinear(down, key=reader.key(names.down))
    if not spec.gated:
        return FeedForward(DenseLinear(ins, key=reader.key(names.up)), down_linear, spec.activation)
    gate = DenseLinear(ins[:f], key=reader.key(names.gate))
    up = DenseLinear(ins[f:], key=reader.key(names.up))
    return GatedMLP(ProjectionGroup([(gate, [f]), (up, [f])]), down_linear, spec.activation)


SPARSE_MOE = FeedForwardKind(SparseMoENames(), build_sparse_moe)
