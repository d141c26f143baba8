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
) -> tuple[torch.Tensor, float]:
    """Return ``(L, damping_used)`` for a symmetric PSD ``hessian`` ``(n, n)``, computed in float64.

    ``damping`` is relative to the mean diagonal. It is raised tenfold (up to 4 times) while
    the Cholesky factorisation fails; ``L`` is the identity (``damping_used = inf``) when the
    Hessian is unusable.
    """
    n = hessian.shape[0]
    h = hessian.double()
    eye = torch.eye(n, dtype=torch.float64, device=h.device)
    if not torch.isfinite(h).all():
        if warn:
            warn("Hessian has NaN/inf entries; quantizing without error feedback")
        return eye, float("inf")
    h = (h + h.T) / 2
    diag_mean = h.diagonal().mean().item()
    if diag_mean <= 0:
        if warn:
            warn("Hessian is zero (no calibration signal reached this layer); no error feedback")
        return eye, float("inf")
    damp = damping
    for _ in range(5):
        chol, info = torch.linalg.cholesky_ex(h + damp * diag_mean * eye)
        if info.item() == 0 and torch.isfinite(chol).all():
            blocks = chol.reshape(n // block, block, n // block, block).diagonal(dim1=0, dim2=2)
            b_inv = torch.linalg.inv(blocks.permute(2, 0, 1))  # (n/block, block, block)
            # L[:, block j] = C[:, block j] @ B_j^{-1}, without forming the block-diagonal matrix.
            lower = torch.einsum("rjb,jbc->rjc", chol.view(n, n // block, block), b_inv)
            return lower.reshape(n, n), damp
        retry = max(damp * 10, 1e-4)
        if warn:
            warn(f"Hessian not positive definite with damping {damp:g}; retrying with {retry:g}")
        damp = retry
    if warn:
        warn("Hessian could not be factorised; quantizing without error feedback")
    return eye, float("inf")
