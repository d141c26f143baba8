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
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, gate_up: ProjectionGroup, down: nn.Module, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation '{activation}'")
        self.gate_up = gate_up
        self.down = down
        self.activation = activation
        self.act = ACTIVATIONS[activation]

    def quantizable_linears(self) -> list[LinearSite]:
        return [*self.gate_up.sites(("gate", "up")), LinearSite("down", self, "down")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        if gate.is_cuda:  # act and product in one launch (ext/fused_ops.cu)
            fused = kernels.fused.act_mul(gate, up, self.activation)
            if fused is not None:
                return self.down(fused)
        return self.down(self.act(gate) * up)
