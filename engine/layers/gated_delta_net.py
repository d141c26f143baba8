"""The gated delta net as a mixer kind (Qwen3-Next, Qwen3.5, OLMo-Hybrid): its spec, where
checkpoints keep its weights, how they become a
:class:`~engine.modules.gated_delta_net.GatedDeltaNet`, and the state it keeps per sequence.

Checkpoints store the input projections in one of three ways, all read here:

- Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, fused and grouped by key head
  (``GatedDeltaNetSpec.head_grouped``); ExLlamaV3 quantizes ``in_proj_qkvz`` as it is.
- Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
- OLMo-Hybrid: ``q_proj``, ``k_proj``, ``v_proj`` (an ExLlamaV3 conversion: one ``in_proj_qkv``),
  ``g_proj`` for the gate, ``b_proj``, ``a_proj``; and its convolution as three weights
  ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (``GatedDeltaNetNames.conv_parts``).

The ``b``/``a`` projections, the convolution, ``A_log``, ``dt_bias`` and the gated norm stay in 16
bits (read as stored; a converter copies them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.cache.state import RecurrentState
from engine.layers.kind import MixerKind
from engine.layers.spec import MixerSpec
from engine.modules.causal_conv import CausalConv1d
from engine.modules.gated_delta_net import (
    CHUNK_SIZE,
    GatedDeltaNet,
    GatedRMSNorm,
    HeadGroupedProjections,
    SplitProjections,
)
from engine.modules.linear import ProjectionGroup

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class GatedDeltaNetSpec(MixerSpec):
    kind: ClassVar[str] = "gated_delta_net"

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6  # the gated output norm's
    beta_scale: float = 1.0  # 2.0: OLMo-Hybrid's negative eigenvalues (beta in (0, 2))
    head_grouped: bool = False  # Qwen3-Next's fused in_proj_qkvz / in_proj_ba
    chunk_size: int = CHUNK_SIZE

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class GatedDeltaNetNames:
    kind: ClassVar[str] = "gated_delta_net"

    qkvz: str = "linear_attn.in_proj_qkvz"  # head-grouped layout
    ba: str = "linear_attn.in_proj_ba"
    qkv: str = "linear_attn.in_proj_qkv"  # split layout: q, k and v in one ...
    qkv_parts: tuple[str, str, str] | None = None  # ... or apart, where the checkpoint has them
    z: str = "linear_attn.in_proj_z"
    b: str = "linear_attn.in_proj_b"
    a: str = "linear_attn.in_proj_a"
    conv: str = "linear_attn.conv1d"
    conv_parts: tuple[str, str, str] | None = None  # q, k and v's convolutions apart (OLMo-Hybrid)
    A_log: str = "linear_attn.A_log"
    dt_bias: str = "linear_attn.dt_bias"
    norm: str = "linear_attn.norm"
    out_proj: str = "linear_attn.out_proj"


def build_gated_delta_net(
    reader: LayerReader, spec: GatedDeltaNetSpec, names: GatedDeltaNetNames
) -> GatedDeltaNet:
    h, kd, vd, heads = reader.hidden_size, spec.key_dim, spec.value_dim, spec.num_v_heads
    if spec.head_grouped:
        projections = HeadGroupedProjections(
            reader.linear(names.qkvz, h, 2 * kd + 2 * vd),
            reader.linear(names.ba, h, 2 * heads),
            spec.num_k_heads,
            heads,
            spec.k_head_dim,
            spec.v_head_dim,
        )
    else:
        if names.qkv_parts is not None and reader.has_linear(names.qkv_parts[0]):
            qkv = reader.projections(list(names.qkv_parts), h, [kd, kd, vd])
        else:
            qkv = ProjectionGroup([(reader.linear(names.qkv, h, 2 * kd + vd), [kd, kd, vd])])
        projections = SplitProjections(
            qkv,
            reader.linear(names.z, h, vd),
            reader.linear(names.b, h, heads),
            reader.linear(names.a, h, heads),
            spec.v_head_dim,
        )
    return GatedDeltaNet(
        projections,
        CausalConv1d(_conv_weight(reader, spec, names), activation="silu"),
        reader.tensor(names.A_log, [heads]),
        reader.tensor(names.dt_bias, [heads]),
        GatedRMSNorm(reader.tensor(f"{names.norm}.weight", [spec.v_head_dim]), spec.norm_eps),
        reader.linear(names.out_proj, vd, h),
        spec.num_k_heads,
        spec.k_head_dim,
        spec.v_head_dim,
        spec.beta_scale,
        spec.chunk_size,
    )


def _conv_weight(reader: LayerReader, spec: GatedDeltaNetSpec, names: GatedDeltaNetNames) -> torch.Tensor:
    """The convolution's ``[channels, K]`` weight over q, k and v: stored as one, or in three."""
    k = spec.conv_kernel
    if names.conv_parts is None or reader.has(f"{names.conv}.weight"):
        return reader.tensor(f"{names.conv}.weight", [spec.conv_channels, 1, k])[:, 0]
    sizes = (spec.key_dim, spec.key_dim, spec.value_dim)
    parts = [reader.tensor(f"{n}.weight", [c, 1, k])[:, 0] for n, c in zip(names.conv_parts, sizes)]
    return torch.cat(parts)


def gated_delta_state(spec: GatedDeltaNetSpec) -> RecurrentState:
    """The convolution's last ``K - 1`` inputs and every value head's state matrix, in float32:
    the state accumulates over the whole sequence, and 16 bits would round it at every token."""
    return RecurrentState(
        {
            "conv": (spec.conv_channels, spec.conv_kernel - 1),
            "delta": (spec.num_v_heads, spec.k_head_dim, spec.v_head_dim),
        },
        dtype=torch.float32,
    )


GATED_DELTA_NET = MixerKind(GatedDeltaNetNames(), build_gated_delta_net, gated_delta_state)
