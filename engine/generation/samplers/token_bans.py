"""Token bans at one position: what a banned string's rewind leaves behind.

When a banned string appears in the reply, generation goes back to the token where it started
(``engine.generation.samplers.banned_strings``) and draws that position again with the token it
had there banned; a later rewind to the same position bans one more. ``HostRow.banned`` holds the
ids banned at the row's position; they are removed like a constraint's mask removes tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.generation.sampling import SamplingBatch

_NEG_INF = float("-inf")


def apply(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.host is None:
        return x
    vocab = x.shape[1]
    for r, host in enumerate(b.host):
        ids = [t for t in host.banned if 0 <= t < vocab]
        if ids and len(ids) < vocab:  # never ban every token: a dead row draws nothing sensible
            x[r, torch.tensor(ids, dtype=torch.long, device=x.device)] = _NEG_INF
    return x
