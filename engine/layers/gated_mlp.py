"""The gated MLP as a feed-forward kind: its spec, where checkpoints keep its weights (three
matrices, or gate and up fused in one) and how they become a
:class:`~engine.modules.mlp.GatedMLP`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.layers.kind import FeedForwardKind
from engine.layers.spec import FeedForwardSpec
from engine.modules.mlp import GatedMLP

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class GatedMLPSpec(FeedForwardSpec):
    kind: ClassVar[str] = "gated_mlp"

    intermediate_size: int
    activation: str = "silu"
    bias: bool = False
    limit: float | None = None  # a clamped SwiGLU's bound (GatedMLP's limit; Step 3.5)


@dataclass(frozen=True)
class GatedMLPNames:
    kind: ClassVar[str] = "gated_mlp"

    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    gate_up_fused: str | None = None  # one matrix for gate and up (Phi-3's gate_up_proj)
    down: str = "mlp.down_proj"


def build_gated_mlp(reader: LayerReader, spec: GatedMLPSpec, names: GatedMLPNames) -> GatedMLP:
    h, f = reader.hidden_size, spec.intermediate_size
    gate_up = reader.projections([names.gate, names.up], h, [f, f], spec.bias, names.gate_up_fused)
    return GatedMLP(gate_up, reader.linear(names.down, f, h, spec.bias), spec.activation, spec.limit)


GATED_MLP = FeedForwardKind(GatedMLPNames(), build_gated_mlp)
