"""Learned attention sinks (GPT-OSS; Xiao et al., 2023 for the idea): each head has one learned
logit that joins the softmax's denominator as if it were one more key, but with no value. A head
can so put part of its attention "nowhere": its weights over the real keys sum to less than one.

``softmax_with_sinks`` is the definition the torch paths that compute scores themselves use (the
CPU decode over cache runs, the paged decode reference, prompts with a softcap as well).
``sdpa_with_sinks`` computes the same attention for a prompt through SDPA's fused kernels, which
never hold the ``[heads, queries, keys]`` scores (4 GiB per layer for a 4K prompt of gpt-oss-20b).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def sdpa_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention with one sink logit per head through ``F.scaled_dot_product_attention``:
    ``q`` ``[heads, n, d]``, ``k``/``v`` ``[kv_heads, L, d]`` (each shared by ``heads / kv_heads``
    consecutive query heads), ``allowed`` ``[n, L]`` bool, ``sinks`` ``[heads]``; returns
    ``[heads, n, d]``.

    The sink becomes a real key that every query sees, with a zero value: two extra feature
    columns hold the head's sink logit (over ``scale``) on the query side, split into a high and
    a low part of the query's dtype so that their sum, accumulated in float32 by the kernel, is
    the logit to float32 precision, and ones on the sink key's side (zeros on the real keys').
    Then ``q' . k_sink * scale`` is the sink logit, ``q' . k_j`` is ``q . k_j``, and the softmax's
    denominator counts the sink as :func:`softmax_with_sinks` does. Widths are padded to a
    multiple of 8 for the fused kernels."""
    heads, n, d = q.shape
    width = (d + 2 + 7) // 8 * 8
    logit = sinks.float() / scale
    high = logit.to(q.dtype)
    low = (logit - high.float()).to(q.dtype)
    q2 = q.new_zeros(heads, n, width)
    q2[..., :d] = q
    q2[..., d] = high[:, None]
    q2[..., d + 1] = low[:, None]
    # Each KV head copied out to its query heads in the same pass that widens it.
    kv_heads, length = k.shape[0], k.shape[1]
    k2 = k.new_zeros(heads, length + 1, width)
    k2.view(kv_heads, heads // kv_heads, length + 1, width)[:, :, :-1, :d] = k[:, None]
    k2[:, -1, d : d + 2] = 1
    v2 = v.new_zeros(heads, length + 1, width)  # the sink's value row stays zero
    v2.view(kv_heads, heads // kv_heads, length + 1, width)[:, :, :-1, :d] = v[:, None]
    sees_sink = torch.ones(n, 1, dtype=torch.bool, device=allowed.device)
    mask = torch.cat([allowed, sees_sink], dim=1)
    out = F.scaled_dot_product_attention(q2[None], k2[None], v2[None], attn_mask=mask, scale=scale)[0]
    return out[..., :d]
