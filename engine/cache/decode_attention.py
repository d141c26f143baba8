"""Decode attention straight from the paged cache: one new query per sequence, fixed shapes.

A decode step has exactly one query per sequence, at position ``lengths[b] - 1`` (its own key and
value are already written). This entry point takes the sequences' block tables as one padded
``[batch, max_pages]`` tensor and their lengths as a device tensor, so the work has the same
shapes whatever the lengths are: it can be captured in a CUDA graph once and replayed.

:func:`paged_decode_attention` dispatches to the CUDA kernel (``engine.kernels.attention``) when one applies;
:func:`paged_decode_attention_reference` is the torch definition both are tested against. The
reference reads every listed page and masks positions at or past each sequence's length, so it
is graph-safe too (only slower: it gathers the whole padded table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.modules.attention_sinks import softmax_with_sinks


def paged_decode_attention_reference(
    q: torch.Tensor,
    layer,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[batch, heads, head_dim]`` over each sequence's cached keys/values.

    ``layer`` is a :class:`engine.cache.paged.KVCacheLayer` (dense or quantized sides);
    ``block_tables`` ``[batch, max_pages]`` (int) lists each sequence's pages in order, padded
    with any valid page; ``lengths`` ``[batch]`` (int) counts the cached positions including the
    query's own. With ``window``, keys more than ``window - 1`` positions back are not seen.
    ``sinks`` ``[heads]``: learned sink logits in each head's softmax denominator. Returns
    ``[batch, heads, head_dim]`` in ``q``'s dtype.
    """
    batch, heads, head_dim = q.shape
    pages = block_tables.shape[1]
    offsets = torch.arange(page_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * page_size + offsets).reshape(-1)  # [batch * max_len]
    keys, values = layer.read(slots)
    max_len = pages * page_size
    kv_heads = keys.shape[1]
    keys = keys.view(batch, max_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    values = values.view(batch, max_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    positions = torch.arange(max_len, device=q.device)
    last = lengths.long()[:, None] - 1
    visible = positions[None, :] <= last
    if window is not None:
        visible &= positions[None, :] > last - window
    qh = q[:, :, None, :]  # [batch, heads, 1, d]
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=heads != kv_heads
        )
    else:  # SDPA has neither a softcap nor a sink term
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        # Scores in float32 from the start: fp16 products of a few hundred would keep ~0.06 of
        # error into the softmax (the kernels accumulate in float32 too).
        scores = torch.matmul(qh.float(), keys.float().transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        if sinks is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            weights = softmax_with_sinks(scores, sinks[None, :, None])
        out = torch.matmul(weights, values.float()).to(q.dtype)
    return out[:, :, 0, :]


def paged_decode_attention(
    q: torch.Tensor,
    layer,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention_reference`'s result, from the CUDA kernel where it applies
    (``sinks`` included), else from the reference (graph-safe too)."""
    from engine import kernels

    args = (q, layer, block_tables, lengths, page_size, scale, window, softcap)
    fast = kernels.attention.paged_decode_attention(*args, sinks=sinks)
    if fast is not None:
        return fast
    return paged_decode_attention_reference(*args, sinks)
