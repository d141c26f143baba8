"""The quantizer's memory-lean forms give the same bits as the straightforward formulas they
replaced (block LDL, the Hessian rotation, the staged Hadamards, in-place LDLQ, the pre-pass's
error prediction, the refit's decoded weight)."""

from __future__ import annotations

import pytest
import torch

import engine.convert.quantize as quantize_mod
from engine.convert.ldl import block_ldl
from engine.convert.quantize import (
    Incoherent,
    decode_states,
    input_hadamard,
    ldlq_in_place,
    ldlq_many,
    rotated_hessian,
)
from engine.convert.sensitivity import FEEDBACK_ITERATIONS, ldlq_errors
from engine.exl3.codebooks import codebook_table
from engine.exl3.hadamard import blockwise_hadamard, blockwise_hadamard_into
from engine.exl3.reconstruct import apply_scales


def _reference_block_ldl(
    hessian: torch.Tensor, damping: float, block: int = 16
) -> tuple[torch.Tensor, float]:
    """block_ldl as it was written before it was made lean (identity matrices, einsum)."""
    n = hessian.shape[0]
    h = hessian.double()
    eye = torch.eye(n, dtype=torch.float64)
    h = (h + h.T) / 2
    diag_mean = h.diagonal().mean().item()
    damp = damping
    for _ in range(5):
        chol, info = torch.linalg.cholesky_ex(h + damp * diag_mean * eye)
        if info.item() == 0 and torch.isfinite(chol).all():
            blocks = chol.reshape(n // block, block, n // block, block).diagonal(dim1=0, dim2=2)
            b_inv = torch.linalg.inv(blocks.permute(2, 0, 1))
            lower = torch.einsum("rjb,jbc->rjc", chol.view(n, n // block, block), b_inv)
            return lower.reshape(n, n), damp
        damp = max(damp * 10, 1e-4)
    return eye, float("inf")


def _spd(n: int, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rank, n, generator=gen, dtype=torch.float64)
    h = x.T @ x / rank
    h[0, 1] += 1e-9  # not exactly symmetric, as a summed Hessian need not be
    return h


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(("rank", "damping"), [(512, 0.01), (40, 0.0)])  # (40, 0.0): the retry path
def test_block_ldl_equals_the_identity_matrix_formula(rank: int, damping: float) -> None:
    h = _spd(128, rank, seed=rank)
    h[5, :] = 0.0
    h[:, 5] = -0.0  # signed zeros: the damped copy must turn them into +0.0 as h + damp * I did
    messages: list[str] = []
    lower, damp = block_ldl(h, damping, warn=messages.append)
    expected, expected_damp = _reference_block_ldl(h, damping)
    assert damp == expected_damp and (damp > damping) == (rank == 40)
    assert _same_bits(lower.contiguous(), expected.contiguous()) and lower.is_contiguous()
    lower32, _ = block_ldl(h, damping, dtype=torch.float32)
    assert _same_bits(lower32, expected.float()) and lower32.is_contiguous()
    assert _same_bits(
        h,
        _spd(128, rank, seed=rank)
        .index_fill_(0, torch.tensor([5]), 0.0)
        .index_fill_(1, torch.tensor([5]), -0.0),
    )


def test_block_ldl_float32_input_and_unusable_hessians() -> None:
    h = _spd(64, 256, seed=3).float()
    lower, _ = block_ldl(h)
    assert _same_bits(lower, _reference_block_ldl(h, 0.01)[0].contiguous())
    eye, damp = block_ldl(torch.zeros(32, 32), dtype=torch.float32)
    assert damp == float("inf") and eye.dtype == torch.float32 and torch.equal(eye, torch.eye(32))


@pytest.mark.parametrize("dim", [0, 1])
def test_blockwise_hadamard_into_matches_blockwise_hadamard(dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(256, 384, generator=gen, dtype=torch.float64)
    expected = blockwise_hadamard(x, dim)
    staging, out = torch.empty_like(x), torch.empty_like(x)
    assert _same_bits(blockwise_hadamard_into(x, dim, out, staging).contiguous(), expected.contiguous())
    # In place (x's own buffer as out) needs the staging copy; without one it is refused.
    own = x.clone()
    if dim == 0:
        result = blockwise_hadamard_into(own, dim, own, staging)
        assert result.stride() == expected.stride() and _same_bits(result.contiguous(), expected.contiguous())
    else:
        with pytest.raises(ValueError):
            blockwise_hadamard_into(own, dim, own)


def test_rotated_hessian_and_input_hadamard_equal_their_formulas() -> None:
    gen = torch.Generator().manual_seed(7)
    hessian = _spd(200, 400, seed=7).float()  # 200 inputs: padded to 256
    su = torch.randn(256, generator=gen) + 0.1
    h, lower, damp = rotated_hessian(hessian, su)
    padded = torch.zeros(256, 256, dtype=torch.float64)
    padded[:200, :200] = hessian.double()
    s = su.double() / float(su.abs().max())
    expected = blockwise_hadamard(blockwise_hadamard(s.unsqueeze(1) * padded * s.unsqueeze(0), dim=0), dim=1)
    assert _same_bits(h, expected.contiguous()) and h.is_contiguous()
    ref_lower, ref_damp = _reference_block_ldl(expected, 0.01)
    assert damp == ref_damp and _same_bits(lower, ref_lower.contiguous())
    _, lower32, _ = rotated_hessian(hessian, su, lower_dtype=torch.float32)
    assert _same_bits(lower32, ref_lower.float().contiguous())

    w = torch.randn(256, 384, generator=gen)
    unit = input_hadamard(w, su)
    reference = blockwise_hadamard(w / su.unsqueeze(1), dim=0)
    assert unit.stride() == reference.stride() and _same_bits(unit.contiguous(), reference.contiguous())


def test_ldlq_in_place_leaves_the_error_and_the_same_states() -> None:
    table = codebook_table("mul1")
    gen = torch.Generator().manual_seed(11)
    problems = []
    for rows in (64, 32):
        x = torch.randn(128, rows, generator=gen)
        lower, _ = block_ldl(x.T @ x / 128)
        problems.append((torch.randn(rows, 48, generator=gen), lower.float()))
    problems.append((torch.randn(32, 32, generator=gen), None))
    expected = ldlq_many(problems, 3, table)
    work = [(t.clone(), lower) for t, lower in problems]
    states = ldlq_in_place(work, 3, table)
    for (target, _), (err, _), st, (exp_states, exp_q) in zip(problems, work, states, expected):
        assert torch.equal(st, exp_states)
        assert _same_bits(decode_states(st, table), exp_q)
        assert _same_bits(err, target - exp_q)


def test_ldlq_many_equals_the_decoded_loop(monkeypatch) -> None:
    """ldlq_many's decoded matrix is the table values of its states in the tile layout, as the
    strip loop used to write them."""
    monkeypatch.setattr(quantize_mod, "DECODE_TILE_ROWS", 1)  # several decode steps
    table = codebook_table("mcg")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 48, generator=gen)
    lower, _ = block_ldl(x.T @ x / 64)
    ((states, q),) = ldlq_many([(torch.randn(48, 32, generator=gen), lower.float())], 2, table)
    expected = quantize_mod.tiles_to_matrix(table[states.long()].float())
    assert _same_bits(q, expected)


def _reference_ldlq_errors(h: torch.Tensor, lower: torch.Tensor, mses: list[float]) -> list[float]:
    h = h.double()
    eye = torch.eye(lower.shape[0], dtype=torch.float64)
    l_inv = torch.linalg.solve_triangular(lower.double(), eye, upper=False, unitriangular=True)
    weight = (l_inv @ h).mul_(l_inv).sum(1)
    gain = (eye - l_inv.T).pow_(2)
    out = []
    for mse in mses:
        v = torch.full_like(weight, mse)
        for _ in range(FEEDBACK_ITERATIONS):
            v = (mse * (1 + gain @ v)).clamp(max=1.0)
        out.append(float((v * weight).sum()))
    return out


def test_ldlq_errors_equal_the_full_formula() -> None:
    h = _spd(256, 300, seed=9)
    lower, _ = block_ldl(h)
    mses = [0.3, 0.05, 0.001]
    assert ldlq_errors(h, lower, mses) == _reference_ldlq_errors(h, lower, mses)


def test_refit_decoded_weight_equals_apply_scales(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(256, 128, generator=gen).half().float()
    suh = (torch.rand(256, generator=gen) + 0.5).half()
    sv = (torch.rand(128, generator=gen) + 0.5).half()
    w = torch.randn(256, 128, generator=gen)
    hessian = _spd(256, 300, seed=13).float()
    seen = {}

    def fake_refit(original, w_hat, h, *args, **kwargs):
        seen["original"], seen["w_hat"], seen["h"] = original.clone(), w_hat.clone(), h
        return quantize_mod.RefitScales(torch.ones(256), torch.ones(128), 0.0, 0.0)

    monkeypatch.setattr(quantize_mod, "refit_scales", fake_refit)
    inc = Incoherent(w.clone(), sv, torch.ones(256), None, torch.zeros(128, dtype=torch.bool))
    quantize_mod._refit(inc, hessian, suh, [q.clone()])
    assert inc.w is None  # let go once the padded weight exists
    assert _same_bits(seen["w_hat"], apply_scales(q, suh, sv))
    assert _same_bits(seen["original"], blockwise_hadamard(w, dim=1) * sv.float())
    assert _same_bits(seen["h"], hessian)


def _reference_refit(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, rounds: int = 2) -> tuple:
    """refit_scales' two scale fits as written before the in-place float64 accumulation (one
    column chunk)."""
    n_in, n_out = w.shape
    rows = torch.ones(n_in, dtype=torch.float64)
    cols = torch.ones(n_out, dtype=torch.float64)
    seen = h.diagonal() > 0
    for _ in range(rounds):
        v, target = w_hat * rows.float()[:, None] * cols.float()[None, :], w
        num = (v * (h @ target)).sum(0, dtype=torch.float64)
        den = (v * (h @ v)).sum(0, dtype=torch.float64)
        c = torch.where(den > 0, num / den.clamp(min=1e-300), torch.ones_like(num))
        cols *= torch.where(torch.isfinite(c) & (c > 0), c, torch.ones_like(c))
        v = w_hat * rows.float()[:, None] * cols.float()[None, :]
        a = torch.zeros(n_in, n_in, dtype=torch.float64)
        a += (v @ v.T).double()
        b = (v * (h @ w)).sum(1, dtype=torch.float64)
        a *= h.double()
        a.diagonal().add_(1e-9 * float(a.diagonal().mean()) + 1e-300)
        r = torch.linalg.solve(a, torch.zeros(n_in, dtype=torch.float64) + b)
        rows *= torch.where(seen & torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
    return rows.float(), cols.float()


def test_refit_scales_equal_the_float64_copy_formula() -> None:
    from engine.convert.refit import refit_scales

    gen = torch.Generator().manual_seed(17)
    w = torch.randn(64, 48, generator=gen)
    w_hat = w * (1 + 0.1 * torch.randn(64, 1, generator=gen)) + 0.01 * torch.randn(64, 48, generator=gen)
    h = _spd(64, 200, seed=17).float()
    fit = refit_scales(w, w_hat, h)
    rows, cols = _reference_refit(w, w_hat, h)
    if fit.after < fit.before:  # kept (not reset to ones by the never-worse guard)
        assert _same_bits(fit.rows, rows) and _same_bits(fit.cols, cols)
    else:
        pytest.fail("the test problem should improve")
