"""Linear layers: one interface over dense and quantized weights.

Every projection in the module library is a ``Linear``-like module with ``in_features``,
``out_features``, ``key`` (the checkpoint key it was read from, "" for one made otherwise) and
``forward(x) = x @ W.T + b``. Dense weights use :class:`DenseLinear`; EXL3 weights use
``engine.exl3.exl3_linear.EXL3Linear``; the builder picks per tensor. :class:`ProjectionGroup`
runs projections that share an input (q/k/v, gate/up), whether the checkpoint stores them as
separate matrices or as one fused matrix. A module lists the linears a converter may quantize as
:class:`LinearSite` entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, key: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ProjectionGroup(nn.Module):
    """Projections of one input, returned as a list of outputs in a fixed order.

    ``parts`` is a list of ``(linear, split_sizes)``: a separate q/k/v checkpoint gives three
    linears with one split each, a fused ``qkv_proj`` one linear split three ways.
    ``output_keys``: the checkpoint keys of the outputs of a fused linear, where they are stored
    apart once quantized (Phi-3's ``qkv_proj`` becomes ``q_proj``, ``k_proj``, ``v_proj``).
    """

    def __init__(
        self, parts: list[tuple[nn.Module, list[int]]], output_keys: Sequence[str] | None = None
    ) -> None:
        super().__init__()
        self.linears = nn.ModuleList([linear for linear, _ in parts])
        self.splits = [list(splits) for _, splits in parts]
        self.output_keys = list(output_keys) if output_keys is not None else None

    def each(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each linear's whole output, in order (a fused linear's not split)."""
        if not x.is_cuda:
            return [linear(x) for linear in self.linears]
        # Separate EXL3 matrices of one input on the GPU: one GEMV launch per as many of them as
        # the kernel takes (each launch has fixed costs that dominate the small k/v projections);
        # exl3_gemm_multi's None -> one launch per linear.
        step = kernels.gemv.GEMV_MAX_MATRICES
        ys: list[torch.Tensor] = []
        for first in range(0, len(self.linears), step):
            chunk = list(self.linears[first : first + step])
            together = kernels.gemv.exl3_gemm_multi(x, chunk) if len(chunk) > 1 else None
            ys.extend(together if together is not None else [linear(x) for linear in chunk])
        return ys

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs: list[torch.Tensor] = []
        for y, splits in zip(self.each(x), self.splits):
            outputs.extend(y.split(splits, dim=-1) if len(splits) > 1 else [y])
        return outputs

    def sites(self, roles: Sequence[str]) -> list[LinearSite]:
        """Each linear's :class:`LinearSite`, ``roles`` naming the outputs in order; a fused
        linear's role joins those of its outputs ("q+k+v")."""
        sites, first = [], 0
        for i, splits in enumerate(self.splits):
            sites.append(LinearSite("+".join(roles[first : first + len(splits)]), self.linears, str(i)))
            first += len(splits)
        return sites


@dataclass
class LinearSite:
    """Where a quantizable linear sits: attribute ``attr`` of ``parent`` (an index into it where
    ``parent`` is a ``ModuleList``). ``role`` says what it computes (q, k, v, o, gate, up, down,
    ...); ``routed``: a mixture-of-experts expert's, which sees only the tokens routed to it."""

    role: str
    parent: nn.Module
    attr: str
    routed: bool = False

    def get(self) -> nn.Module:
        return self.parent[int(self.attr)] if self.attr.isdigit() else getattr(self.parent, self.attr)
