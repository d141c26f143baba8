"""The non-gated MLP as a feed-forward kind, ``down(act(up(x)))`` (NemotronH's squared-ReLU
MLP): its spec, where checkpoints keep its two matrices, and how they become a
:class:`~engine.modules.feed_forward.FeedForward`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.layers.kind import FeedForwardKind
from engine.layers.spec import FeedForwardSpec
from engine.modules.feed_forward import FeedForward

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class PlainMLPSpec(FeedForwardSpec):
    kind: ClassVar[str] = "plain_mlp"

    intermediate_size: int
    activation: str = "relu2"
    bias: bool = False


@dataclass(frozen=True)
class PlainMLPNames:
    kind: ClassVar[str] = "plain_mlp"

    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"


def build_plain_mlp(reader: LayerReader, spec: PlainMLPSpec, names: PlainMLPNames) -> FeedForward:
    h, f = reader.hidden_size, spec.intermediate_size
    return FeedForward(
        reader.linear(names.up, h, f, spec.bias), reader.linear(names.down, f, h, spec.bias), spec.activation
    )


PLAIN_MLP = FeedForwardKind(PlainMLPNames(), build_plain_mlp)
