"""A mixture's routed experts as one tensor per projection kind, for kernels that pick an expert
by its index on the device (``engine.kernels.moe``).

Every expert of a layer has the same shapes, so the packed EXL3 weights of each projection kind
(gate, up, down) stack into ``[experts, in/16, out/16, 16K]`` with a fixed per-expert stride, their
sign vectors into ``[experts, in]`` and ``[experts, out]``. The experts' own linears are then
re-pointed at their slices of the stacks (views): the weights are held once, and each expert still
runs on its own (the torch path, prefill).

Stacking declines (``None``) where the kernels could not take the experts: other than streaming
EXL3 linears, experts of different shapes, bits per weight, codebooks or activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.modules.feed_forward import FeedForward
from engine.modules.mlp import ACTIVATIONS, GatedMLP


@dataclass(frozen=True)
class ExpertActivation:
    """What an expert computes between its projections (the fields of
    :class:`~engine.modules.mlp.GatedMLP`): ``act(gate) * up`` where ``gated`` (clamped at
    ``limit`` where it is set, ``up_offset`` added to the clipped up), else ``act(up)``."""

    name: str
    gated: bool
    limit: float | None = None
    limit_after_act: bool = True
    up_offset: float = 0.0


@dataclass
class StackedLinears:
    """One projection kind of every expert: the streaming EXL3 tensors stacked along a new first
    dim, and the biases (float32 ``[experts, out_features]``, None without)."""

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None
    codebook: str
    in_features: int
    out_features: int

    @property
    def bits(self) -> int:
        return self.trellis.shape[-1] // 16

    @property
    def padded_in(self) -> int:
        return self.trellis.shape[1] * 16

    @property
    def padded_out(self) -> int:
        return self.trellis.shape[2] * 16


@dataclass
class StackedExperts:
    """A layer's routed experts stacked (``gate`` None for plain two-layer experts)."""

    gate: StackedLinears | None
    up: StackedLinears
    down: StackedLinears
    activation: ExpertActivation
    first: nn.Module  # expert 0's up linear: tells whether its buffers are still the stack's

    @property
    def num_experts(self) -> int:
        return self.up.trellis.shape[0]

    @property
    def device(self) -> torch.device:
        return self.up.trellis.device

    def current(self) -> bool:
        """Whether the experts still hold their slices of the stacks (a move or a dtype change of
        the module gives them new tensors, and the stacks would be stale)."""
        first = self.first
        return (
            first.trellis.data_ptr() == self.up.trellis.data_ptr()
            and first.suh.data_ptr() == self.up.suh.data_ptr()
            and first.svh.data_ptr() == self.up.svh.data_ptr()
        )


def _parts(expert: nn.Module) -> tuple[nn.Module | None, nn.Module, nn.Module, ExpertActivation] | None:
    """``(gate, up, down, activation)`` of a gated or plain expert; None for any other module (or a
    gated one whose gate and up are one fused linear)."""
    if isinstance(expert, GatedMLP):
        group = expert.gate_up
        if len(group.linears) != 2 or any(len(s) != 1 for s in group.splits):
            return None
        act = ExpertActivation(
            expert.activation, True, expert.limit, expert.limit_after_act, float(expert.up_offset)
        )
        return group.linears[0], group.linears[1], expert.down, act
    if isinstance(expert, FeedForward):
        # FeedForward keeps the function, not its name; a module activation (with weights of its
        # own) has none the kernels know.
        name = next((n for n, fn in ACTIVATIONS.items() if fn is expert.act), None)
        return None if name is None else (None, expert.fc1, expert.fc2, ExpertActivation(name, False))
    return None


def _streaming(linear: nn.Module) -> bool:
    return getattr(linear, "mode", None) == "streaming" and hasattr(linear, "trellis")


def _alike(linears: Sequence[nn.Module]) -> bool:
    """Same stored shape (so the same bits per weight), codebook, features, device, and all or
    none with a bias."""
    first = linears[0]
    return all(
        _streaming(lin)
        and lin.trellis.shape == first.trellis.shape
        and lin.trellis.dtype == first.trellis.dtype
        and lin.trellis.device == first.trellis.device
        and lin.codebook == first.codebook
        and (lin.in_features, lin.out_features) == (first.in_features, first.out_features)
        and (lin.bias is None) == (first.bias is None)
        for lin in linears
    )


def _stack(linears: Sequence[nn.Module]) -> StackedLinears:
    """The stacks of one projection kind; each linear's buffers become views of its slice (the
    separate copies are then freed)."""
    first = linears[0]
    trellis = torch.stack([lin.trellis for lin in linears])
    suh = torch.stack([lin.suh for lin in linears])
    svh = torch.stack([lin.svh for lin in linears])
    bias = None
    if first.bias is not None:
        bias = torch.stack([lin.bias.float() for lin in linears]).contiguous()
    for e, lin in enumerate(linears):
        lin.trellis, lin.suh, lin.svh = trellis[e], suh[e], svh[e]
    return StackedLinears(trellis, suh, svh, bias, first.codebook, first.in_features, first.out_features)


@torch.no_grad()
def stack_experts(experts: Sequence[nn.Module]) -> StackedExperts | None:
    """The experts' weights stacked per projection kind (and the experts re-pointed at them), or
    None where the experts do not allow it (see the module docstring); then nothing changes."""
    if not experts:
        return None
    parts = [_parts(expert) for expert in experts]
    if any(p is None for p in parts):
        return None
    gates, ups, downs, acts = zip(*parts)
    if any(act != acts[0] for act in acts):
        return None
    gated = acts[0].gated
    kinds = [ups, downs, *([gates] if gated else [])]
    if not all(_alike(kind) for kind in kinds):
        return None
    if gated and (
        gates[0].trellis.shape[:2] != ups[0].trellis.shape[:2] or gates[0].out_features != ups[0].out_features
    ):
        return None
    if downs[0].in_features != ups[0].out_features or downs[0].out_features != ups[0].in_features:
        return None
    gate = _stack(gates) if gated else None
    return StackedExperts(gate, _stack(ups), _stack(downs), acts[0], ups[0])
