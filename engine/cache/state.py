"""What a layer keeps per sequence between steps, as its mixer kind declares it.

A mixer kind (``engine.layers``) says which of these its layers need, and the cache
(``engine.cache.paged``) gives every layer the storage of its declaration:

- :class:`KVPages`: keys and values of every position so far, in the cache's pages (attention).
  It grows with the sequence, and a page full of a shared prompt prefix can serve every
  sequence that starts with that prefix.
- :class:`RecurrentState`: tensors of a fixed size per sequence, whatever its length (a gated
  delta net's or Mamba-2's state matrix, a short convolution's last inputs). Each running
  sequence holds one *slot* of them, from its first step until it finishes.
- ``None``: nothing (a mixer that reads only the step's own tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVPages:
    """Keys and values of ``kv_heads`` x ``head_dim`` per position, stored in pages."""

    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RecurrentState:
    """Named tensors of fixed ``shapes`` per sequence, in ``dtype`` (None: the cache's dtype).

    A mixer starts a sequence from zeros (its first step has ``past == 0``) and updates its slot
    as the sequence goes on; the slot is given back when the sequence finishes.
    """

    shapes: Mapping[str, tuple[int, ...]] = field(hash=False)
    dtype: torch.dtype | None = None


SequenceState = KVPages | RecurrentState
