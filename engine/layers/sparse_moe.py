"""The sparse mixture of experts as a feed-forward kind (Mixtral, Qwen-MoE; with Qwen2-MoE's
shared expert): its spec, where checkpoints keep its router and experts, and how they become a
:class:`~engine.modules.moe.SparseMoE`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.layers.gated_mlp import GatedMLPNames, GatedMLPSpec, build_gated_mlp
from engine.layers.kind import FeedForwardKind
from engine.layers.spec import FeedForwardSpec
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

if TYPE_CHECKING:
    import torch

    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class SparseMoESpec(FeedForwardSpec):
    kind: ClassVar[str] = "sparse_moe"

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # each expert's
    normalize: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    activation: str = "silu"
    shared_expert_size: int = 0  # Qwen2-MoE's expert every token goes through (0: none)


@dataclass(frozen=True)
class SparseMoENames:
    """The router, each expert's projections as the Hub checkpoints store them (``{e}`` = expert
    index), and the fused 3-D ``gate_up_proj`` [experts, 2 * f, hidden] / ``down_proj``
    [experts, hidden, f] that transformers 5 keeps in memory, under ``experts_fused``."""

    kind: ClassVar[str] = "sparse_moe"

    router: str = "mlp.gate"
    expert_gate: str = "mlp.experts.{e}.gate_proj"
    expert_up: str = "mlp.experts.{e}.up_proj"
    expert_down: str = "mlp.experts.{e}.down_proj"
    experts_fused: str = "mlp.experts"
    shared_expert: str = "mlp.shared_expert"  # a gated MLP (gate_proj, up_proj, down_proj) ...
    shared_expert_gate: str = "mlp.shared_expert_gate"  # ... scaled by sigmoid(this linear)

    def expert(self, e: int) -> GatedMLPNames:
        return GatedMLPNames(
            self.expert_gate.format(e=e), self.expert_up.format(e=e), None, self.expert_down.format(e=e)
        )


def build_sparse_moe(reader: LayerReader, spec: SparseMoESpec, names: SparseMoENames) -> SparseMoE:
    """Experts stored one linear each (the Hub's layout, and every EXL3 conversion's) are read as
    such; otherwise the fused 3-D tensors of transformers 5 are sliced per expert (views: no
    copy), each slice keyed as the expert's own linear would be."""
    h, f, count = reader.hidden_size, spec.intermediate_size, spec.num_experts
    router = reader.linear(names.router, h, count)
    fused = names.experts_fused
    expert = GatedMLPSpec(f, spec.activation)
    if not reader.has_linear(names.expert(0).gate) and reader.has(f"{fused}.gate_up_proj"):
        gate_up = reader.packed_tensor(f"{fused}.gate_up_proj", [count, 2 * f, h])
        down = reader.packed_tensor(f"{fused}.down_proj", [count, h, f])
        experts = [
            _sliced_expert(reader, names.expert(e), gate_up[e], down[e], spec.activation)
            for e in range(count)
        ]
    else:
        experts = [build_gated_mlp(reader, expert, names.expert(e)) for e in range(count)]
    shared = shared_gate = None
    if spec.shared_expert_size:
        k = names.shared_expert
        shared_names = GatedMLPNames(f"{k}.gate_proj", f"{k}.up_proj", None, f"{k}.down_proj")
        shared = build_gated_mlp(reader, GatedMLPSpec(spec.shared_expert_size, spec.activation), shared_names)
        shared_gate = reader.linear(names.shared_expert_gate, h, 1)
    return SparseMoE(router, experts, spec.experts_per_token, spec.normalize, shared, shared_gate)


def _sliced_expert(
    reader: LayerReader, names: GatedMLPNames, gate_up: torch.Tensor, down: torch.Tensor, activation: str
) -> GatedMLP:
    f = down.shape[1]
    gate = DenseLinear(gate_up[:f], key=reader.key(names.gate))
    up = DenseLinear(gate_up[f:], key=reader.key(names.up))
    return GatedMLP(
        ProjectionGroup([(gate, [f]), (up, [f])]), DenseLinear(down, key=reader.key(names.down)), activation
    )


SPARSE_MOE = FeedForwardKind(SparseMoENames(), build_sparse_moe)
