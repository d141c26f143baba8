"""XTC ("exclude top choices"): now and then, take away the likeliest tokens.

With probability ``xtc_probability`` per token (a coin from the job's own generator, drawn by the
caller: ``HostRow.xtc_u``), every token whose probability is at least ``xtc_threshold`` is
removed except the least likely of them; where fewer than two reach the threshold nothing
changes, so the model is never left without a plausible token. It runs on the distribution as
the truncations before it left it (after temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.generation.sampling import SamplingBatch

_NEG_INF = float("-inf")


def apply(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    for r, s in enumerate(b.settings or ()):
        if s.xtc_probability <= 0 or b.host is None or s.is_greedy:
            continue
        if not b.host[r].xtc_u < s.xtc_probability:  # this token's coin says: leave it be
            continue
        p = torch.softmax(x[r], dim=0)
        above = p >= s.xtc_threshold
        if int(above.sum()) < 2:
            continue
        least = p.masked_fill(~above, float("inf")).min()
        x[r].masked_fill_(above & (p > least), _NEG_INF)
    return x
