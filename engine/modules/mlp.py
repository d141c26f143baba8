"""The gated feed-forward block (Shazeer, 2020: GLU variants)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.modules.linear import LinearSite, ProjectionGroup

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (So et al., 2021: Primer; NemotronH)
    # x * sigmoid(1.702 x), GELU's sigmoid approximation (Hendrycks & Gimpel); gpt-oss's gate
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``.

    ``limit``: a clamped SwiGLU, whose large activations are cut off: ``up`` clipped to
    ``[-limit, limit]`` and the gate capped at ``limit``, after its activation
    (``limit_after_act``, Step 3.5's swiglu_limits) or before it (gpt-oss). ``up_offset`` is
    added to the clipped ``up`` (gpt-oss: 1, so ``act(gate) * (up + 1)``).
    """

    def __init__(
        self,
        gate_up: ProjectionGroup,
        down: nn.Module,
        activation: str,
        limit: float | None = None,
        limit_after_act: bool = True,
        up_offset: float = 0.0,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation '{activation}'")
        self.gate_up = gate_up
        self.down = down
        self.activation = activation
        self.limit, self.limit_after_act = limit, limit_after_act
        self.up_offset = up_offset

    def quantizable_linears(self) -> list[LinearSite]:
        return [*self.gate_up.sites(("gate", "up")), LinearSite("down", self, "down")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(
            gated_product(gate, up, self.activation, self.limit, self.limit_after_act, self.up_offset)
        )


def gated_product(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    limit: float | None = None,
    limit_after_act: bool = True,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """``act(gate) * up``, clamped as :class:`GatedMLP` describes where ``limit`` is set: what a
    gated MLP computes between its projections (also the grouped experts',
    ``engine.modules.grouped_experts``)."""
    act = ACTIVATIONS[activation]
    if limit is not None:  # the fused kernel does not clamp
        up = up.clamp(-limit, limit)
        if up_offset:
            up = up + up_offset
        if limit_after_act:
            return act(gate).clamp(max=limit) * up
        return act(gate.clamp(max=limit)) * up
    if gate.is_cuda:  # act and product in one launch (ext/fused_ops.cu)
        fused = kernels.fused.act_mul(gate, up, activation)
        if fused is not None:
            return fused
    return act(gate) * up
