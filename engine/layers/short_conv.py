"""LFM2's gated short convolution as a mixer kind: its spec, where checkpoints keep its weights
(the Hub's names, which ExLlamaV3's conversions keep: ``conv.in_proj``, ``conv.conv``,
``conv.out_proj``), how they become a :class:`~engine.modules.short_conv.ShortConv`, and the
convolution window it keeps per sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.cache.state import RecurrentState
from engine.layers.kind import MixerKind
from engine.layers.spec import MixerSpec
from engine.modules.causal_conv import CausalConv1d
from engine.modules.short_conv import ShortConv

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class ShortConvSpec(MixerSpec):
    """A convolution of ``kernel_size`` taps (conv_L_cache) over ``hidden_size`` channels;
    ``bias``: the projections and the convolution have biases (conv_bias)."""

    kind: ClassVar[str] = "short_conv"

    hidden_size: int
    kernel_size: int = 3
    bias: bool = False


@dataclass(frozen=True)
class ShortConvNames:
    kind: ClassVar[str] = "short_conv"

    in_proj: str = "conv.in_proj"
    conv: str = "conv.conv"  # an nn.Conv1d weight [hidden, 1, kernel]
    out_proj: str = "conv.out_proj"


def build_short_conv(reader: LayerReader, spec: ShortConvSpec, names: ShortConvNames) -> ShortConv:
    """The projections may be quantized; the convolution is read as stored (a converter copies
    it in 16 bits)."""
    h, k = spec.hidden_size, spec.kernel_size
    weight = reader.tensor(f"{names.conv}.weight", [h, 1, k])[:, 0]
    bias = reader.tensor(f"{names.conv}.bias", [h]) if spec.bias else None
    return ShortConv(
        reader.linear(names.in_proj, h, 3 * h, spec.bias),
        CausalConv1d(weight, bias),
        reader.linear(names.out_proj, h, h, spec.bias),
    )


def conv_window(spec: ShortConvSpec) -> RecurrentState:
    """The last ``kernel - 1`` inputs of the convolution, in the cache's dtype: they are the
    activations themselves, not a sum that would round in 16 bits."""
    return RecurrentState({"conv": (spec.hidden_size, spec.kernel_size - 1)})


SHORT_CONV = MixerKind(ShortConvNames(), build_short_conv, conv_window)
