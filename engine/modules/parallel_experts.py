"""A dense MLP and a mixture of experts side by side on the residual stream (Gemma 4's MoE
layers): each reads the stream through its own pre-norm (the router reads it as it is), each
output is normalised again, and the two are summed. Every token always gets the dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from engine.modules.linear import LinearSite


class ParallelExperts(nn.Module):
    """``mlp_out_norm(mlp(mlp_norm(h))) + moe_out_norm(moe(h))``; ``moe`` normalises its experts'
    input itself (``SparseMoE.expert_norm``), its router reads ``h``."""

    def __init__(
        self,
        mlp_norm: nn.Module,
        mlp: nn.Module,
        mlp_out_norm: nn.Module,
        moe: nn.Module,
        moe_out_norm: nn.Module,
    ) -> None:
        super().__init__()
        # Registered in the order they run (the converter writes their tensors in this order).
        self.mlp_norm, self.mlp, self.mlp_out_norm = mlp_norm, mlp, mlp_out_norm
        self.moe, self.moe_out_norm = moe, moe_out_norm

    @property
    def dynamic_decode(self) -> str | None:
        """The mixture's reason (``engine.modules.moe.SparseMoE.dynamic_decode``), if it has one."""
        return getattr(self.moe, "dynamic_decode", "mixture-of-experts")

    def quantizable_linears(self) -> list[LinearSite]:
        return [*self.mlp.quantizable_linears(), *self.moe.quantizable_linears()]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp_out_norm(self.mlp(self.mlp_norm(h))) + self.moe_out_norm(self.moe(h))
