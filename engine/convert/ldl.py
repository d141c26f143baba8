"""Hessian conditioning and the block LDL decomposition used by LDLQ.

LDLQ (QuIP/QTIP) needs ``H = L D L^T`` with ``L`` unit *block* lower-triangular (16x16 blocks,
one per strip of tile rows) and ``D`` block-diagonal. From a Cholesky factor ``H = C C^T``:
``L = C B^{-1}`` and ``D = B B^T`` where ``B`` is the block diagonal of ``C``.

Real Hessians are often singular (dead inputs, padding rows, too little calibration data), so
we damp the diagonal and, when the factorisation still fails or the Hessian has NaNs, fall back
to more damping and finally to the identity (no error feedback) with a message instead of a crash.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCK = 16


def block_ldl(
    hessian: torch.Tensor,
    damping: float = 0.01,
    block: int = BLOCK,
    warn: Callable[[str], None] | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, float]:
    """Return ``(L, damping_used)`` for a symmetric PSD ``hessian`` ``(n, n)``, computed in float64
    (``L`` returned in ``dtype``: the quantizer only needs float32, half the memory).

    ``damping`` is relative to the mean diagonal. It is raised tenfold (up to 4 times) while
    the Cholesky factorisation fails; ``L`` is the identity (``damping_used = inf``) when the
    Hessian is unusable.

    Memory: besides ``hessian`` (left as it is), at most two ``n x n`` float64 buffers at a time
    (an 8B model's down projection has n = 14336: 1.6 GB each). The symmetrised copy is damped in
    place rather than through identity matrices, and each buffer is let go as soon as the next
    form exists; the values are those of ``(h + h.T) / 2 + damp * mean(diag) * I`` bit for bit.
    """
    n = hessian.shape[0]
    h = hessian.double()
    if not torch.isfinite(h).all():
        if warn:
            warn("Hessian has NaN/inf entries; quantizing without error feedback")
        return _identity(n, dtype, h.device), float("inf")
    sym = h + h.T
    del h  # the caller's tensor (or a float64 copy of it, which goes now)
    sym.div_(2)
    # ``x + damp * diag_mean * I`` added +0.0 off the diagonal, which turns -0.0 into +0.0; keep
    # that so the factor's zeros have the same signs.
    sym.add_(0.0)
    diag_mean = sym.diagonal().mean().item()
    if diag_mean <= 0:
        if warn:
            warn("Hessian is zero (no calibration signal reached this layer); no error feedback")
        return _identity(n, dtype, sym.device), float("inf")
    undamped = sym.diagonal().clone()  # n values: a retry damps the undamped diagonal again
    damp = damping
    for attempt in range(5):
        if attempt:
            sym.diagonal().copy_(undamped)
        sym.diagonal().add_(damp * diag_mean)
        chol, info = torch.linalg.cholesky_ex(sym)
        if info.item() == 0 and torch.isfinite(chol).all():
            del sym, undamped
            factor = [chol]  # handed over, so _unit_lower can let it go before its last copy
            del chol
            return _unit_lower(factor, block, dtype), damp
        del chol
        retry = max(damp * 10, 1e-4)
        if warn:
            warn(f"Hessian not positive definite with damping {damp:g}; retrying with {retry:g}")
        damp = retry
    if warn:
        warn("Hessian could not be factorised; quantizing without error feedback")
    return _identity(n, dtype, sym.device), float("inf")


def _identity(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.eye(n, dtype=dtype, device=device)


def _unit_lower(factor: list[torch.Tensor], block: int, dtype: torch.dtype) -> torch.Tensor:
    """``L = C B^{-1}`` from the Cholesky factor ``C``, the one item of ``factor`` (taken out of
    it: the caller keeps no reference, so it is freed early), as a contiguous ``(n, n)`` tensor
    in ``dtype``.

    ``L[:, block j] = C[:, block j] @ B_j^{-1}``, without forming the block-diagonal matrix. This
    is the batched GEMM that ``einsum("rjb,jbc->rjc", C.view(n, n/block, block), B^{-1})``
    runs (same operands, same strides), then its result's copy to row-major order, but the
    factor is let go before that copy and the copy converts to ``dtype`` on the way.
    """
    chol = factor.pop()
    n = chol.shape[0]
    blocks = chol.reshape(n // block, block, n // block, block).diagonal(dim1=0, dim2=2)
    b_inv = torch.linalg.inv(blocks.permute(2, 0, 1))  # (n/block, block, block)
    del blocks
    per_block = torch.bmm(chol.view(n, n // block, block).permute(1, 0, 2), b_inv)  # (n/block, n, block)
    del chol
    lower = torch.empty(n, n // block, block, dtype=dtype, device=per_block.device)
    return lower.copy_(per_block.permute(1, 0, 2)).view(n, n)
