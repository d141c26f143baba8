"""The non-gated MLP as a feed-forward kind, ``down(act(up(x)))`` (NemotronH's and Arcee's
squared-ReLU MLPs, Apertus' xIELU one): its spec, where checkpoints keep its two matrices (and
the activation's own weights, for xIELU), and how they become a
:class:`~engine.modules.feed_forward.FeedForward`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.layers.kind import FeedForwardKind
from engine.layers.spec import FeedForwardSpec
from engine.modules.feed_forward import FeedForward
from engine.modules.xielu import XIELU

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class PlainMLPSpec(FeedForwardSpec):
    kind: ClassVar[str] = "plain_mlp"

    intermediate_size: int
    activation: str = "relu2"  # a name in engine.modules.mlp.ACTIVATIONS, or "xielu"
    bias: bool = False


@dataclass(frozen=True)
class PlainMLPNames:
    kind: ClassVar[str] = "plain_mlp"

    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    xielu: str = "mlp.act_fn"  # xIELU's learned curvatures alpha_p and alpha_n, and beta and eps


def build_plain_mlp(reader: LayerReader, spec: PlainMLPSpec, names: PlainMLPNames) -> FeedForward:
    h, f = reader.hidden_size, spec.intermediate_size
    activation = _xielu(reader, names.xielu) if spec.activation == "xielu" else spec.activation
    return FeedForward(
        reader.linear(names.up, h, f, spec.bias), reader.linear(names.down, f, h, spec.bias), activation
    )


def _xielu(reader: LayerReader, name: str) -> XIELU:
    """xIELU with the layer's curvatures; its fixed ``beta`` and ``eps`` as stored where the
    checkpoint keeps them (transformers saves them, an EXL3 conversion need not)."""
    fixed = {k: reader.tensor(f"{name}.{k}", []) for k in ("beta", "eps") if reader.has(f"{name}.{k}")}
    return XIELU(reader.tensor(f"{name}.alpha_p", [1]), reader.tensor(f"{name}.alpha_n", [1]), **fixed)


PLAIN_MLP = FeedForwardKind(PlainMLPNames(), build_plain_mlp)
