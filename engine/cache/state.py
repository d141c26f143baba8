"""What a layer keeps per sequence between steps, as its mixer kind declares it.

A mixer kind (``engine.layers``) says which of these its layers need, and the cache
(``engine.cache.paged``) gives every layer the storage of its declaration:

- :class:`KVPages`: keys and values of every position so far, in the cache's pages (attention).
  It grows with the sequence, and a page full of a shared prompt prefix can serve every
  sequence that starts with that prefix.
- :class:`LatentPages`: one compressed row per position, in the same pages, that stands for
  every head's key and value (multi-head latent attention: DeepSeek-V3).
- :class:`SharedPages`: another layer's keys and values, read and never written (Gemma 4's
  layers that reuse an earlier layer's): nothing of its own.
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
class LatentPages:
    """``width`` numbers per position, stored in pages as :class:`KVPages` are (so prefix reuse
    works alike): multi-head latent attention's normalised latent and the rotated key part all
    heads share, from which the layer recovers each head's key and value. A position costs
    ``width`` numbers instead of ``2 * kv_heads * head_dim``."""

    width: int


@dataclass(frozen=True)
class SharedPages:
    """The :class:`KVPages` of the earlier layer ``source``, which this layer reads as its own: it
    keeps nothing, so a position costs nothing in it (Gemma 4's ``num_kv_shared_layers``)."""

    source: int


@dataclass(frozen=True)
class RecurrentState:
    """Named tensors of fixed ``shapes`` per sequence, in ``dtype`` (None: the cache's dtype).

    A mixer starts a sequence from zeros (its first step has ``past == 0``) and updates its slot
    as the sequence goes on; the slot is given back when the sequence finishes.
    """

    shapes: Mapping[str, tuple[int, ...]] = field(hash=False)
    dtype: torch.dtype | None = None


SequenceState = KVPages | LatentPages | SharedPages | RecurrentState
