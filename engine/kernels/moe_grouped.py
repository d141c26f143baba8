"""A mixture's stacked EXL3 experts decoded whole, a range of experts at a time, for the grouped
prefill GEMMs (``engine.modules.grouped_experts``).

:func:`decode_experts` writes ``W`` ``(padded_in, padded_out)`` of each expert of a range into
its slice of one ``[experts, padded_in, columns]`` buffer (decode, both Hadamards and the scales,
so the buffer holds the true weights): in bf16 one launch per projection kind for the whole range
(``ext.exl3_weight_stack_into``), in other dtypes one per expert and kind
(``ext.exl3_weight_into``); several projection kinds of one input side by side (gate then up), as
``engine.kernels.gemv.exl3_weight`` lays out a dense prefill's projections.

Stacks are passed in, not imported: anything with ``trellis``, ``suh``, ``svh`` (stacked along a
first experts dim), ``codebook``, ``padded_in`` and ``padded_out``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.kernels import loader
from engine.kernels.loader import CODEBOOK_IDS


def decode_experts(stacks: Sequence[Any], first: int, last: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Experts ``first..last-1`` of one or more stacked projection kinds of one input (all with the
    same ``padded_in``), decoded into a ``dtype`` buffer ``[last - first, padded_in, sum of
    padded_out]``, the kinds side by side in the order given. None without the extension (or one
    built without ``exl3_weight_into``)."""
    head = stacks[0]
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"decode_experts makes fp16, bf16 or fp32 weights, not {dtype}")
    if not 0 <= first < last <= head.trellis.shape[0]:
        raise ValueError(f"decode_experts: experts {first}..{last - 1} of {head.trellis.shape[0]}")
    if any(s.padded_in != head.padded_in for s in stacks):
        raise ValueError("decode_experts: the stacks of one buffer must share their (padded) in features")
    ext = loader.kernel_ready(*(s.trellis for s in stacks))
    if ext is None or not hasattr(ext, "exl3_weight_into"):
        return None
    columns = sum(s.padded_out for s in stacks)
    w = torch.empty(last - first, head.padded_in, columns, dtype=dtype, device=head.trellis.device)
    if dtype == torch.bfloat16 and hasattr(ext, "exl3_weight_stack_into"):
        col = 0
        for s in stacks:
            ext.exl3_weight_stack_into(
                s.trellis[first:last], s.suh[first:last], s.svh[first:last], CODEBOOK_IDS[s.codebook], w, col
            )
            col += s.padded_out
        return w
    for i, e in enumerate(range(first, last)):
        col = 0
        for s in stacks:
            ext.exl3_weight_into(s.trellis[e], s.suh[e], s.svh[e], CODEBOOK_IDS[s.codebook], w[i], col)
            col += s.padded_out
    return w
