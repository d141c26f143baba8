"""Learned attention sinks (GPT-OSS; Xiao et al., 2023 for the idea): each head has one learned
logit that joins the softmax's denominator as if it were one more key, but with no value. A head
can so put part of its attention "nowhere": its weights over the real keys sum to less than one.

``softmax_with_sinks`` is the one definition every torch attention path uses (prefill, the CPU
decode over cache runs, the paged decode reference), so they agree with each other exactly.
"""

from __future__ import annotations

import torch


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Float32 attention weights ``[..., keys]`` from ``scores`` (masked keys at ``-inf``), whose
    denominator also counts ``exp(sink)``; ``sinks`` broadcasts against ``scores[..., 0]`` (one
    logit per head). A row whose keys are all masked gets zeros, not NaNs."""
    scores, sinks = scores.float(), sinks.float()
    # Subtract the larger of the row's maximum and the sink: neither exponential can overflow.
    top = torch.maximum(scores.amax(dim=-1), sinks)
    weights = torch.exp(scores - top[..., None])
    denominator = weights.sum(dim=-1) + torch.exp(sinks - top)
    return weights / denominator[..., None]
