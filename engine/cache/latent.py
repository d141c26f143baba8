"""A latent attention layer's cache (:class:`~engine.cache.state.LatentPages`): one row of
``width`` numbers per cache slot, in the same pages and slots as the key/value layers.

Multi-head latent attention keeps per position only its normalised latent and the rotated key
part every head shares; each head's key and value are recovered from them
(``engine.modules.latent_attention``). The row is stored as a single "head" of ``width``
numbers, dense or quantized by the store the key/value layers use (``engine.cache.quantized``),
so its 2-8 bit form is the same Hadamard-rotated groups with one scale each.
"""

from __future__ import annotations

import torch

from engine.cache.quantized import DenseStore, QuantizedStore, group_size
from engine.cache_footprint import latent_bits
from engine.errors import UsageError


class LatentCacheLayer:
    """Rows ``[slots, width]`` of one latent attention layer, stored at the wider of the cache's
    key and value widths (:func:`~engine.cache_footprint.latent_bits`)."""

    def __init__(
        self,
        width: int,
        num_slots: int,
        bits: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.width, self.dtype = width, dtype
        self.bits = latent_bits(bits)
        if self.bits >= 16:
            self.store: DenseStore | QuantizedStore = DenseStore(num_slots, 1, width, dtype, device)
            return
        try:
            group_size(width)
        except ValueError:
            raise UsageError(
                f"a {self.bits}-bit cache cannot hold this model's latent attention rows: each "
                f"position keeps {width} numbers (kv_lora_rank + qk_rope_head_dim), and the "
                "quantized cache packs groups of 8; use an unquantized cache (16 bits)"
            ) from None
        self.store = QuantizedStore(num_slots, 1, width, self.bits, device)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` ``[n, width]`` at ``slots``."""
        self.store.write(slots, rows[:, None, :])

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows at ``slots``, ``[n, width]`` in the cache's dtype."""
        return self.store.read(slots, self.dtype)[:, 0, :]

    @property
    def nbytes(self) -> int:
        return self.store.nbytes
