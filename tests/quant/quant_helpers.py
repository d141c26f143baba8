"""Helpers shared by the converter tests (imported as ``quant_helpers``: pytest puts this folder on
the path)."""

from __future__ import annotations

import torch

from engine.quant.trellis import pack_states, unpack_states


def cheap_encoder(x: torch.Tensor, k: int, table: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """A fast, valid, low-quality stand-in for the Viterbi (``quantize.encode_tiles``): greedy
    along the trellis (best next code for each value), made tail-biting by pack -> unpack (which
    only changes the first few states)."""
    values = table.float()
    codes = torch.arange(1 << k, device=x.device)
    state = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    for i in range(x.shape[1]):
        cand = ((state.unsqueeze(1) << k) | codes) & 0xFFFF
        best = (values[cand] - x[:, i : i + 1]).abs().argmin(dim=1)
        state = cand.gather(1, best.unsqueeze(1)).squeeze(1)
        out[:, i] = state.to(torch.int32)
    return unpack_states(pack_states(out, k))
