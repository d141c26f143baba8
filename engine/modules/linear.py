"""Linear layers: one interface over dense and quantized weights.

Every projection in the module library is a ``Linear``-like module with ``in_features``,
``out_features`` and ``forward(x) = x @ W.T + b``. Dense weights use :class:`DenseLinear`;
EXL3 weights use ``engine.quant.exl3_linear.EXL3Linear``; the builder picks per tensor.
:class:`ProjectionGroup` runs projections that share an input (q/k/v, gate/up), whether the
checkpoint stores them as separate matrices or as one fused matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ProjectionGroup(nn.Module):
    """Projections of one input, returned as a list of outputs in a fixed order.

    ``parts`` is a list of ``(linear, split_sizes)``: a separate q/k/v checkpoint gives three
    linears with one split each, a fused ``qkv_proj`` one linear split three ways.
    """

    def __init__(self, parts: list[tuple[nn.Module, list[int]]]) -> None:
        super().__init__()
        self.linears = nn.ModuleList([linear for linear, _ in parts])
        self.splits = [list(splits) for _, splits in parts]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs: list[torch.Tensor] = []
        # Separate EXL3 matrices of one input on the GPU: one GEMV launch for all of them (each
        # launch has fixed costs that dominate the small k/v projections); None -> one per linear.
        ys = ops.exl3_gemm_multi(x, list(self.linears)) if x.is_cuda and len(self.linears) > 1 else None
        for i, (linear, splits) in enumerate(zip(self.linears, self.splits)):
            y = linear(x) if ys is None else ys[i]
            outputs.extend(y.split(splits, dim=-1) if len(splits) > 1 else [y])
        return outputs
