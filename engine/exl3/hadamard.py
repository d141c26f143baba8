"""The 128-point blockwise Hadamard transform of EXL3 (docs/EXL3_FORMAT.md section 7, the rotation).

``H128[i, j] = (-1)**popcount(i & j) / sqrt(128)`` (Sylvester order), symmetric and its own
inverse. A dimension of size n (a multiple of 128) is transformed in n/128 independent blocks.
We apply it as a batched matmul with the explicit 128x128 matrix: on CPU and GPU that is a
well-tuned BLAS call and, unlike a Python-level butterfly, costs one kernel launch.
"""

from __future__ import annotations

import math
from functools import cache

import torch

HADAMARD_SIZE = 128


@cache
def _sylvester_cpu(n: int) -> torch.Tensor:
    """Normalised Sylvester-order Hadamard matrix of size n (a power of two), float64."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    i = torch.arange(n, dtype=torch.int64)
    and_ij = i.unsqueeze(1) & i.unsqueeze(0)
    # popcount parity of i & j, bit by bit (n <= 2**20 in any sane use).
    parity = torch.zeros_like(and_ij)
    for bit in range(max(n.bit_length() - 1, 0)):
        parity ^= (and_ij >> bit) & 1
    return (1.0 - 2.0 * parity.to(torch.float64)) / math.sqrt(n)


@cache
def _cached(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _sylvester_cpu(n).to(device=device, dtype=dtype)


def hadamard_matrix(
    n: int = HADAMARD_SIZE, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The normalised ``n x n`` Sylvester Hadamard matrix (cached; treat it as read-only)."""
    return _cached(n, dtype, torch.device(device))


def blockwise_hadamard(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Apply ``I_{n/128} (x) H128`` along ``dim`` of ``x`` (n must be a multiple of 128).

    Computed in ``x``'s dtype (use float32/float64 input for reference accuracy). Since H128 is
    symmetric, this is both the row-vector and the column-vector application (section 7).
    """
    dim = dim % x.ndim
    n = x.shape[dim]
    if n % HADAMARD_SIZE:
        raise ValueError(f"blockwise Hadamard needs a multiple of {HADAMARD_SIZE}, got {n}")
    moved = x.movedim(dim, -1)
    # One 2-D GEMM over all 128-blocks: batched small matmuls (and float64 ones especially) hit
    # slow paths on CPU.
    blocks = moved.reshape(-1, HADAMARD_SIZE)
    out = torch.mm(blocks, hadamard_matrix(HADAMARD_SIZE, x.dtype, x.device))
    return out.reshape(moved.shape).movedim(-1, dim)


def blockwise_hadamard_into(
    x: torch.Tensor, dim: int, out: torch.Tensor, staging: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`blockwise_hadamard` bit for bit, with the result written to ``out`` (contiguous, of
    ``x``'s numel and dtype), which may hold ``x`` itself.

    Where ``x`` is not laid out along ``dim`` (a transform along dim 0 of a row-major matrix),
    :func:`blockwise_hadamard` copies it to a contiguous buffer first; here that copy goes to
    ``staging`` (contiguous, same size), so a caller that owns its buffers can rotate a large
    matrix with two of them instead of four (the copy, the result, and the inputs the caller
    still holds). Same GEMM on the same values in the same layout: the same bits.
    """
    dim = dim % x.ndim
    n = x.shape[dim]
    if n % HADAMARD_SIZE:
        raise ValueError(f"blockwise Hadamard needs a multiple of {HADAMARD_SIZE}, got {n}")
    moved = x.movedim(dim, -1)
    if moved.is_contiguous():  # where reshape would have viewed rather than copied
        if out.data_ptr() == moved.data_ptr():
            raise ValueError("out may hold x only when x is copied to staging first")
        blocks = moved.view(-1, HADAMARD_SIZE)
    else:
        if staging is None:
            raise ValueError("x is not contiguous along dim: a staging buffer is needed")
        blocks = staging.view(moved.shape).copy_(moved).view(-1, HADAMARD_SIZE)
    torch.mm(blocks, hadamard_matrix(HADAMARD_SIZE, x.dtype, x.device), out=out.view(-1, HADAMARD_SIZE))
    return out.view(moved.shape).movedim(-1, dim)
