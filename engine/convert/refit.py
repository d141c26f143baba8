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

Everything runs over column chunks with the multipliers kept apart from ``W_hat``, so the extra
memory is a few ``in x chunk`` blocks and the ``in x in`` system, not copies of the whole weight
(a 70B model's head is 8192 x 128256).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

CHUNK = 16384  # output columns per step


@dataclass
class RefitScales:
    """Per-row and per-column multipliers for ``suh`` and ``svh`` and the loss they reach."""

    rows: torch.Tensor = field(repr=False)  # (n_in,) multiplies suh
    cols: torch.Tensor = field(repr=False)  # (n_out,) multiplies svh
    before: float  # tr(E^T H E) / tr(W^T H W) with the original scales
    after: float  # the same with the refit scales


def _chunks(n: int, chunk: int) -> Iterator[slice]:
    for start in range(0, n, chunk):
        yield slice(start, min(start + chunk, n))


def refit_scales(
    w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor, rounds: int = 2, chunk: int = CHUNK
) -> RefitScales:
    """Multipliers for the scales of ``w_hat`` (format orientation ``(in, out)``) that lower
    ``tr((W - W_hat)^T H (W - W_hat))`` against the target ``w``; ``hessian`` is ``(in, in)``.

    Rows the Hessian never saw (zero diagonal: padding, dead inputs) and solutions that are not
    finite and positive keep a multiplier of 1: a sign flip or zero would be a fit to noise.
    Products are float32, sums and the solve float64.
    """
    h = hessian.float()
    n_in, n_out = w.shape
    rows = torch.ones(n_in, dtype=torch.float64, device=w.device)
    cols = torch.ones(n_out, dtype=torch.float64, device=w.device)
    seen = h.diagonal() > 0

    def scaled(part: slice) -> torch.Tensor:  # diag(rows) W_hat diag(cols), columns ``part``
        return w_hat[:, part].float() * rows.float()[:, None] * cols[part].float()[None, :]

    def loss() -> float:
        num = den = 0.0
        for part in _chunks(n_out, chunk):
            target = w[:, part].float()
            e = target - scaled(part)
            num += float(((h @ e) * e).sum(dtype=torch.float64))
            den += float(((h @ target) * target).sum(dtype=torch.float64))
        return num / max(den, 1e-30)

    before = loss()
    for _ in range(rounds):
        for part in _chunks(n_out, chunk):
            v, target = scaled(part), w[:, part].float()
            num = (v * (h @ target)).sum(0, dtype=torch.float64)
            den = (v * (h @ v)).sum(0, dtype=torch.float64)
            c = torch.where(den > 0, num / den.clamp(min=1e-300), torch.ones_like(num))
            cols[part] *= torch.where(torch.isfinite(c) & (c > 0), c, torch.ones_like(c))

        a = torch.zeros(n_in, n_in, dtype=torch.float64, device=w.device)
        b = torch.zeros(n_in, dtype=torch.float64, device=w.device)
        for part in _chunks(n_out, chunk):
            v = scaled(part)
            a.add_(v @ v.T)  # promoted to float64 as it is added: no float64 copy of the product
            b += (v * (h @ w[:, part].float())).sum(1, dtype=torch.float64)
        a.mul_(h)  # likewise: the float64 products of h.double(), without that copy on a GPU
        a.diagonal().add_(1e-9 * float(a.diagonal().mean()) + 1e-300)
        r = torch.linalg.solve(a, b)
        rows *= torch.where(seen & torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
    after = loss()
    if after > before:  # only possible through the clamps above; keep what LDLQ chose
        rows, cols, after = torch.ones_like(rows), torch.ones_like(cols), before
    return RefitScales(rows.float(), cols.float(), before, after)
