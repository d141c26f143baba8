"""Refit the per-channel scales of a quantized linear once its trellis is fixed.

An EXL3 weight is ``W_hat = diag(suh) . R . diag(svh)`` with ``R = H_in Q H_out`` decoded from the
trellis. LDLQ chooses ``Q`` for scales fixed beforehand (row and column RMS of ``W``); once ``Q``
is known, the scales that best fit it are a cheap least-squares problem in the layer's own loss,
the proxy error ``tr(E^T H E)`` with ``E = W - W_hat`` and ``H = E[x^T x]``. Both scale vectors are
stored anyway, so a better fit costs nothing at inference.

Each half is exact with the other held fixed, so alternating them never increases the loss:

* output columns (``svh``): column ``n`` only scales ``w_hat_n``, and
  ``c_n = w_hat_n^T H w_n / w_hat_n^T H w_hat_n``;
* input rows (``suh``): ``diag(r) W_hat`` couples rows through ``H``; setting the gradient to zero
  gives ``((W_hat W_hat^T) * H) r = rowsum(W_hat * (H W))`` (``*`` elementwise), one ``in x in``
  solve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RefitScales:
    """Per-row and per-column multipliers for ``suh`` and ``svh`` and the loss they reach."""

    rows: torch.Tensor = field(repr=False)  # (n_in,) multiplies suh
    cols: torch.Tensor = field(repr=False)  # (n_out,) multiplies svh
    before: float  # tr(E^T H E) / tr(W^T H W) with the original scales
    after: float  # the same with the refit scales


def _relative_loss(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, hw: torch.Tensor) -> float:
    e = w - w_hat
    return float(((h @ e) * e).sum(dtype=torch.float64) / (hw * w).sum(dtype=torch.float64).clamp(min=1e-30))


def refit_scales(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor, rounds: int = 2) -> RefitScales:
    """Multipliers for the scales of ``w_hat`` (format orientation ``(in, out)``) that lower
    ``tr((W - W_hat)^T H (W - W_hat))`` against the target ``w``; ``hessian`` is ``(in, in)``.

    Rows the Hessian never saw (zero diagonal: padding, dead inputs) and solutions that are not
    finite and positive keep a multiplier of 1: a sign flip or zero would be a fit to noise.
    The matrices stay float32 (an 8B model's head is 4096 x 128256); sums and the solve are float64.
    """
    h = hessian.float()
    w, w_hat = w.float(), w_hat.float()
    hw = h @ w
    before = _relative_loss(w, w_hat, h, hw)
    rows = torch.ones(w.shape[0], dtype=torch.float64, device=w.device)
    cols = torch.ones(w.shape[1], dtype=torch.float64, device=w.device)
    seen = h.diagonal() > 0
    for _ in range(rounds):
        num = (w_hat * hw).sum(0, dtype=torch.float64)
        den = (w_hat * (h @ w_hat)).sum(0, dtype=torch.float64)
        c = torch.where(den > 0, num / den.clamp(min=1e-300), torch.ones_like(num))
        c = torch.where(torch.isfinite(c) & (c > 0), c, torch.ones_like(c))
        w_hat = w_hat * c.float()
        cols = cols * c

        a = (w_hat @ w_hat.T).double() * h.double()
        a.diagonal().add_(1e-9 * float(a.diagonal().mean()) + 1e-300)
        r = torch.linalg.solve(a, (w_hat * hw).sum(1, dtype=torch.float64))
        r = torch.where(seen & torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
        w_hat = r.float()[:, None] * w_hat
        rows = rows * r
    after = _relative_loss(w, w_hat, h, hw)
    if after > before:  # only possible through the clamps above; keep what LDLQ chose
        return RefitScales(torch.ones_like(rows).float(), torch.ones_like(cols).float(), before, before)
    return RefitScales(rows.float(), cols.float(), before, after)
