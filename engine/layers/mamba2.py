"""Mamba-2 as a mixer kind: its spec, where checkpoints keep its weights (the Hub's names, which
EXL3 conversions keep), how they become a :class:`~engine.modules.mamba2.Mamba2`, and the state it
keeps per sequence (its convolution window and its heads' state matrices)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.cache.state import RecurrentState
from engine.layers.kind import MixerKind
from engine.layers.spec import MixerSpec
from engine.modules.causal_conv import CausalConv1d
from engine.modules.mamba2 import GatedGroupRMSNorm, Mamba2

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class Mamba2Spec(MixerSpec):
    """``num_heads`` x ``head_dim`` channels (mamba_num_heads, mamba_head_dim), ``groups`` of
    ``state_size`` for B and C (n_groups, ssm_state_size), a convolution of ``conv_kernel``
    taps (with a bias: use_conv_bias), projections with biases (mamba_proj_bias / use_bias),
    scans in chunks of ``chunk_size`` tokens, and a time step clamped to ``dt_limit`` (None:
    unclamped). ``norm_eps``: the gated norm's."""

    kind: ClassVar[str] = "mamba2"

    num_heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 128
    dt_limit: tuple[float, float] | None = None
    norm_eps: float = 1e-5

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """x, B and C: what the convolution sees."""
        return self.intermediate_size + 2 * self.groups * self.state_size


@dataclass(frozen=True)
class Mamba2Names:
    kind: ClassVar[str] = "mamba2"

    in_proj: str = "mixer.in_proj"
    conv: str = "mixer.conv1d"
    A_log: str = "mixer.A_log"
    D: str = "mixer.D"
    dt_bias: str = "mixer.dt_bias"
    norm: str = "mixer.norm"
    out_proj: str = "mixer.out_proj"


def build_mamba2(reader: LayerReader, spec: Mamba2Spec, names: Mamba2Names) -> Mamba2:
    """The projections may be quantized; the convolution, ``A_log``, ``D``, ``dt_bias`` and the
    norm are read as stored (a converter copies them in 16 bits)."""
    h, i, heads, k = reader.hidden_size, spec.intermediate_size, spec.num_heads, spec.conv_kernel
    channels = spec.conv_channels
    in_proj = reader.linear(names.in_proj, h, i + channels + heads, spec.proj_bias)
    weight = reader.tensor(f"{names.conv}.weight", [channels, 1, k])[:, 0]
    bias = reader.tensor(f"{names.conv}.bias", [channels]) if spec.conv_bias else None
    conv = CausalConv1d(weight, bias, activation="silu")
    A_log, D = reader.tensor(names.A_log, [heads]), reader.tensor(names.D, [heads])
    dt_bias = reader.tensor(names.dt_bias, [heads])
    norm = reader.norm(names.norm, i)
    gated_norm = GatedGroupRMSNorm(norm.weight, spec.norm_eps, i // spec.groups, key=norm.key)
    out_proj = reader.linear(names.out_proj, i, h, spec.proj_bias)
    return Mamba2(
        in_proj,
        conv,
        A_log,
        D,
        dt_bias,
        gated_norm,
        out_proj,
        spec.head_dim,
        spec.groups,
        spec.state_size,
        spec.chunk_size,
        spec.dt_limit,
    )


def mamba2_state(spec: Mamba2Spec) -> RecurrentState:
    """The convolution's last ``K - 1`` inputs and every head's state matrix, in float32: the
    state accumulates over the whole sequence, and 16 bits would round it at every token."""
    return RecurrentState(
        {
            "conv": (spec.conv_channels, spec.conv_kernel - 1),
            "ssm": (spec.num_heads, spec.head_dim, spec.state_size),
        },
        dtype=torch.float32,
    )


MAMBA2 = MixerKind(Mamba2Names(), build_mamba2, mamba2_state)
