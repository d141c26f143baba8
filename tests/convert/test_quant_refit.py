"""The scale refit after LDLQ (engine.convert.refit): exact where an exact fit exists, never worse,
and in ``quantize_weight`` a lower layer loss from the same trellis."""

from __future__ import annotations

import torch
from quant_helpers import cheap_encoder

import engine.convert.quantize as quantize_mod
from engine.convert.refit import refit_scales
from engine.exl3 import EXL3Linear


def _hessian(n: int, seed: int, rows: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=gen) * 0.2 + torch.eye(n)
    x = torch.randn(rows, n, generator=gen) @ mix * (torch.rand(n, generator=gen) * 3 + 0.1)
    return x.T @ x / rows


def _loss(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr(E^T H E) / tr(W^T H W) for ``(in, out)`` weights."""
    e = (w - w_hat).double()
    return float(((h.double() @ e) * e).sum() / ((h.double() @ w.double()) * w.double()).sum())


def test_refit_recovers_exact_channel_scales() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen)
    a = torch.rand(64, generator=gen) + 0.5
    b = torch.rand(96, generator=gen) + 0.5
    w_hat = w / a[:, None] / b[None, :]  # the right direction, wrong row and column scales
    h = _hessian(64, 1)
    fit = refit_scales(w, w_hat, h, rounds=8)
    assert fit.before > 0.05 and fit.after < 1e-6
    assert torch.allclose(fit.rows[:, None] * w_hat * fit.cols[None, :], w, atol=2e-3)


def test_refit_never_worse_and_leaves_unseen_rows_alone() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=gen)
    w_hat = w + 0.3 * torch.randn(64, 48, generator=gen)
    h = _hessian(64, 3)
    h[48:] = 0
    h[:, 48:] = 0  # inputs 48.. never carried a signal (padding, dead channels)
    fit = refit_scales(w, w_hat, h)
    assert fit.after <= fit.before
    assert torch.equal(fit.rows[48:], torch.ones(16))
    assert (fit.rows[:48] > 0).all() and (fit.cols > 0).all()
    # The loss it reports is the loss of the rescaled weight.
    assert abs(_loss(w, fit.rows[:, None] * w_hat * fit.cols[None, :], h) - fit.after) < 1e-6
    # Column chunks (bounded memory on a large head) change nothing but the rounding.
    chunked = refit_scales(w, w_hat, h, chunk=7)
    assert torch.allclose(chunked.rows, fit.rows, rtol=1e-4)
    assert torch.allclose(chunked.cols, fit.cols, rtol=1e-4)
    assert abs(chunked.after - fit.after) < 1e-6 * max(fit.after, 1e-3)


def test_quantize_weight_refit_lowers_the_layer_loss(monkeypatch) -> None:
    # Same seed, same trellis: only suh/svh differ, and the stored model's loss drops to what the
    # refit reported (up to the fp16 rounding of the scales).
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(160, 200, generator=gen) * (torch.rand(160, 1, generator=gen) + 0.2)  # HF (out, in)
    h = _hessian(200, 5)
    losses, trellises = {}, {}
    for refit in (False, True):
        qt = quantize_mod.quantize_weight(w, h, 3, "mul1", seed=1, refit=refit)
        layer = EXL3Linear.from_tensors(qt.tensors("x"), 200, 160, None)
        losses[refit] = _loss(w.t(), layer.reconstruct().t(), h)
        trellises[refit] = qt.trellis
        if refit:
            fit = qt.refit
    assert torch.equal(trellises[False], trellises[True])
    assert fit is not None and fit.after < fit.before
    assert abs(fit.before - losses[False]) < 0.01 * losses[False]
    assert losses[True] < losses[False]
    assert abs(losses[True] - fit.after) < 0.01 * fit.after
    plain = quantize_mod.quantize_weight(w, None, 3, "mul1", seed=1)
    assert plain.refit is None  # no Hessian, nothing to fit against
