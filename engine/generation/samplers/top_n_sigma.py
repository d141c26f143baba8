"""Top-n-sigma: keep the tokens whose logit is within ``n`` standard deviations of the best.

The statistics are over the tokens still in the running (finite logits), after temperature; the
rule is scale-free, so temperature before or after does not change which tokens stay. Cheap: one
mean, one standard deviation and a threshold per row, no sort.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.generation.sampling import SamplingBatch

_NEG_INF = float("-inf")


def apply(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    n = b.column_of("top_n_sigma")
    on = (n > 0) & ~b.greedy
    if not bool(on.any()):
        return x
    finite = torch.isfinite(x)
    count = finite.sum(1, keepdim=True).clamp(min=1)
    values = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mean = values.sum(1, keepdim=True) / count
    var = (torch.where(finite, x - mean, torch.zeros((), dtype=x.dtype, device=x.device)) ** 2).sum(
        1, keepdim=True
    ) / count
    threshold = x.max(1, keepdim=True).values - n[:, None] * var.sqrt()
    return x.masked_fill_(on[:, None] & (x < threshold), _NEG_INF)
