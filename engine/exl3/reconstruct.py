"""From stored EXL3 tensors to weights: tile decode + layout -> Q, then Q + scales -> W.

Orientation follows the format (docs/EXL3_FORMAT.md section 4): ``Q`` and ``W`` are ``(in, out)``
and a layer computes ``y = x @ W``; the HF weight is ``W.T``.
"""

from __future__ import annotations

from functools import cache, lru_cache

import torch

from engine.exl3.codebooks import decode_states
from engine.exl3.hadamard import blockwise_hadamard, blockwise_hadamard_into
from engine.exl3.trellis import TILE, TILE_VALUES, unpack_states


@lru_cache(maxsize=1)
def storage_to_tile_index() -> torch.Tensor:
    """Table A of section 6.1: storage position p -> row-major index ``16*row(p) + col(p)``.

    ``p = 8*L + j`` (L = lane 0..31, j = 0..7) lands at
    ``row = 2*(L % 4) + (j % 2) + 8*((j // 2) % 2)`` and ``col = L // 4 + 8*(j // 4)``: the
    fragment order of the tensor-core MMA the reference kernels decode into.
    """
    p = torch.arange(TILE_VALUES, dtype=torch.int64)
    lane, j = p // 8, p % 8
    row = 2 * (lane % 4) + (j % 2) + 8 * ((j // 2) % 2)
    col = lane // 4 + 8 * (j // 4)
    return row * TILE + col


@lru_cache(maxsize=1)
def tile_to_storage_index() -> torch.Tensor:
    """Table B of section 6.1: row-major tile index -> the storage position that holds it."""
    inv = torch.empty(TILE_VALUES, dtype=torch.int64)
    inv[storage_to_tile_index()] = torch.arange(TILE_VALUES, dtype=torch.int64)
    return inv


@cache
def _gather_index(device: torch.device) -> torch.Tensor:
    return tile_to_storage_index().to(device)


def tiles_to_matrix(values: torch.Tensor) -> torch.Tensor:
    """Tile values in storage order ``(A, B, 256)`` -> matrix ``(16A, 16B)`` (section 6.1)."""
    a, b, n = values.shape
    if n != TILE_VALUES:
        raise ValueError(f"expected {TILE_VALUES} values per tile, got {n}")
    tiles = values.index_select(-1, _gather_index(values.device)).reshape(a, b, TILE, TILE)
    # (a, b, r, c) -> (a, r, b, c): row 16a + r is input feature, column 16b + c output feature.
    return tiles.permute(0, 2, 1, 3).reshape(a * TILE, b * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tiles_to_matrix`: ``(16A, 16B)`` -> ``(A, B, 256)`` in storage order."""
    rows, cols = matrix.shape
    if rows % TILE or cols % TILE:
        raise ValueError(f"matrix dims must be multiples of {TILE}, got {tuple(matrix.shape)}")
    a, b = rows // TILE, cols // TILE
    tiles = matrix.reshape(a, TILE, b, TILE).permute(0, 2, 1, 3).reshape(a, b, TILE_VALUES)
    return tiles.index_select(-1, storage_to_tile_index().to(matrix.device))


def decode_trellis(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Decode a trellis ``(in/16, out/16, 16K)`` to the inner weight ``Q`` ``(in, out)`` fp16.

    Bit-exact with the reference ``reconstruct`` kernel (section 10, item 4). Memory: one int32
    state and one fp16 value per weight; decode in row blocks for large tensors.
    """
    if trellis.ndim != 3:
        raise ValueError(f"trellis must be 3-D (in/16, out/16, 16K), got shape {tuple(trellis.shape)}")
    return tiles_to_matrix(decode_states(unpack_states(trellis), codebook))


def expand_sign_bits(packed: torch.Tensor) -> torch.Tensor:
    """Legacy ``su``/``sv`` (section 3.2): int16 words of sign bits -> fp16 vector of +-1.

    Element ``e`` is bit ``e % 16`` (LSB first) of word ``e // 16``; a set bit means -1.
    """
    words = packed.to(torch.int32) & 0xFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(16, dtype=torch.int32, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def apply_scales(
    q: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    in_place: bool = False,
) -> torch.Tensor:
    """``W = diag(suh) . H_in . Q . H_out . diag(svh)`` (section 4), computed in ``dtype``.

    ``Q``'s rows are input features, so ``H_in`` acts along dim 0 and ``H_out`` along dim 1.
    float32 (default) is within fp16 rounding of the exact result; float64 gives the exact one
    for the inputs (Q, suh and svh are fp16, all exactly representable).

    ``in_place`` (``q`` contiguous and already in ``dtype``): ``W`` is formed in ``q``'s own buffer
    with one staging copy, the same values bit for bit (the converter's refit, where ``Q`` may be
    an LM head's 2.1 GB and is not needed afterwards). Not for tensors that need gradients.
    """
    if in_place:
        staging = torch.empty_like(q)
        w = blockwise_hadamard_into(blockwise_hadamard_into(q, 0, q, staging), 1, q, staging)
        del staging
        return w.mul_(suh.to(dtype).unsqueeze(1)).mul_(svh.to(dtype).unsqueeze(0))  # (suh_i w_ij) svh_j
    w = blockwise_hadamard(q.to(dtype), dim=0)
    w = blockwise_hadamard(w, dim=1)
    return suh.to(dtype).unsqueeze(1) * w * svh.to(dtype).unsqueeze(0)
