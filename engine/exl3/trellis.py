"""The packed trellis of one EXL3 tile: 16-bit states from words, and back.

A tile is ``16*K`` int16 words (``trellis[a, b, :]``) holding a circular bitstream of ``256*K``
bits (docs/EXL3_FORMAT.md section 5, the trellis bitstream):

- stream chunk ``c`` (bits ``16c .. 16c+15``, MSB first) is word ``w[c ^ 1]`` (pair swap);
- value ``i`` owns stream bits ``[i*K, i*K+K)``; its 16-bit *state* is the window of 16 bits
  ending at its own bits, ``[(i+1)*K - 16, (i+1)*K)`` taken modulo the stream length
  (tail-biting: the first states start in the last bits of the stream).

Everything here is vectorised over any number of leading tile dimensions and runs on whatever
device the input lives on.
"""

from __future__ import annotations

from functools import cache

import torch

TILE = 16  # tiles are 16x16 weights
TILE_VALUES = TILE * TILE  # 256 values per tile
MAX_BITS = 8


def check_bits(k: int) -> int:
    """Validate a bits-per-weight value K (1..8, section 3.1)."""
    if not 1 <= k <= MAX_BITS:
        raise ValueError(f"EXL3 bits per weight must be 1..{MAX_BITS}, got {k}")
    return k


def bits_of_trellis(trellis: torch.Tensor) -> int:
    """K of a trellis tensor: its last dimension is ``16*K`` words (section 3.1)."""
    words = trellis.shape[-1]
    if words % TILE:
        raise ValueError(f"trellis last dimension must be a multiple of 16, got {words}")
    return check_bits(words // TILE)


def _chunks(words: torch.Tensor) -> torch.Tensor:
    """Words ``(..., 16K)`` -> stream chunks ``(..., 16K)`` as int32 0..65535 (undo the pair swap)."""
    w = words.to(torch.int32) & 0xFFFF
    n = w.shape[-1]
    return w.reshape(*w.shape[:-1], n // 2, 2).flip(-1).reshape(*w.shape[:-1], n)


@cache
def _window_plan(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each value i: the two chunks its 16-bit window touches and the shifts that join them.

    The window starts at stream bit ``s = (i+1)*K - 16 (mod 256K)``: chunk ``j0 = s // 16`` at
    offset ``o = s % 16``. The state is the low ``16 - o`` bits of chunk ``j0`` followed by the
    top ``o`` bits of the next chunk (circularly), i.e.
    ``((c[j0] << o) | (c[j1] >> (16 - o))) & 0xFFFF``; for ``o = 0`` that is just ``c[j0]``.
    """
    n_bits = TILE_VALUES * k
    n_chunks = TILE * k
    i = torch.arange(TILE_VALUES, dtype=torch.int64)
    start = ((i + 1) * k - 16) % n_bits
    j0 = start // 16
    j1 = (j0 + 1) % n_chunks
    o = start % 16
    return j0, j1, o.to(torch.int32), (16 - o).to(torch.int32)


def _plan_on(k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in _window_plan(k))


def unpack_states(trellis: torch.Tensor) -> torch.Tensor:
    """Packed tiles ``(..., 16K)`` int16 -> states ``(..., 256)`` int32 in 0..65535 (section 5).

    States are in storage order (value ``i`` at index ``i``); section 6.1 places them in the tile.
    """
    k = bits_of_trellis(trellis)
    c = _chunks(trellis)
    j0, j1, shl, shr = _plan_on(k, c.device)
    hi = c.index_select(-1, j0)
    lo = c.index_select(-1, j1)
    # A 16-bit shift of lo (offset 0) yields 0, which is what the formula needs.
    return ((hi << shl) | (lo >> shr)) & 0xFFFF


def pack_states(states: torch.Tensor, k: int) -> torch.Tensor:
    """States ``(..., 256)`` -> packed tiles ``(..., 16K)`` int16 (section 5, "A packer writes ...").

    Only the low K bits of each state are stored: the bitshift trellis makes the other 16 - K
    bits the codes of the preceding values, so a consistent state sequence (as the encoder
    produces, and as :func:`unpack_states` returns) survives ``unpack(pack(s)) == s``.
    """
    check_bits(k)
    if states.shape[-1] != TILE_VALUES:
        raise ValueError(f"expected {TILE_VALUES} states per tile, got {states.shape[-1]}")
    lead = states.shape[:-1]
    codes = states.to(torch.int32) & ((1 << k) - 1)
    # Expand each code into its K bits, MSB first: the stream is the codes concatenated.
    bit_shifts = torch.arange(k - 1, -1, -1, dtype=torch.int32, device=states.device)
    bits = (codes.unsqueeze(-1) >> bit_shifts) & 1  # (..., 256, K)
    bits = bits.reshape(*lead, TILE * k, 16)  # 16-bit chunks of the stream
    weights = torch.arange(15, -1, -1, dtype=torch.int32, device=states.device)
    chunks = (bits << weights).sum(dim=-1, dtype=torch.int32)  # (..., 16K), MSB first
    words = chunks.reshape(*lead, 8 * k, 2).flip(-1).reshape(*lead, TILE * k)  # swap pairs
    words = torch.where(words >= 0x8000, words - 0x10000, words)
    return words.to(torch.int16)
