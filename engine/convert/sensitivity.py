"""How much each linear's quantization error costs its block: the converter's pre-pass (issue 3).

Before any weight is quantized, the *unquantized* model runs block by block over a subset of the
calibration rows (the converter's own :func:`~engine.convert.block_runner.run_block` and
:class:`~engine.convert.hessians.HessianHook`). For each block every linear's input Hessian ``H``
is recorded, and for each linear ``l``:

1. **Predicted proxy error** of LDLQ + trellis at each ``K`` (:func:`predicted_proxies`), in the
   units of ``quantize_weight``'s ``proxy_error`` numerator, ``tr(E H E^T)``. LDLQ leaves strip
   errors ``eta = L^T E`` that are roughly independent, each with the trellis's MSE on unit
   Gaussian data (:data:`engine.convert.mse.TRELLIS_MSE`) times its strip target's variance, so
   ``E[tr(E^T H' E)] = n_out * sum_i var(eta_i) (L^{-1} H' L^{-T})_ii`` in the quantizer's
   rotated basis (``H' = H_in diag(su) H diag(su) H_in``, ``L`` its damped block-LDL factor,
   built by the quantizer's own code). Mapped back through the output scales, ``n_out`` becomes
   ``sum(svh^2)``. With ``var(eta) = mse(K)`` this is the ``out * mean(W^2) * mse(K) * tr(D)``
   of the issue (``mean(W^2)`` sits in ``H'`` through ``su``, the per-row RMS). But the error
   feedback inflates the strip targets, ``T_b + sum_{j>b} L_jb^T E_j``, and more so the worse
   ``H`` is conditioned and the lower ``K`` is: without it the prediction was 1.5-3x low at K=2
   on a test problem. So ``var(eta)`` is solved for: ``v = mse(K) (1 + ((I - L^{-T})^2) v)``,
   a few fixed-point steps (error per element capped at the unit signal's variance).
2. **Measured block error**: iid Gaussian noise ``N`` with ``E[tr(N H N^T)]`` equal to that
   prediction (per-element variance ``P / (out * tr(H))``) is added to the linear's weight, the
   block runs again, and ``e_l = mean_t ||y_noisy_t - y_t||^2 / ||y_t||^2`` over tokens ``t``
   is recorded (per token rather than ``||y_noisy - y||^2 / ||y||^2`` over all of them, see
   :func:`relative_change`); the weight is restored. The noise comes from a seeded CPU
   generator, so the pass is deterministic.
3. At another ``K``, ``e_l(K) = e_l(K_ref) * P_l(K) / P_l(K_ref)``: the noise is small enough
   for the block to be linear in it. Without the feedback term that ratio is exactly
   ``mse(K) / mse(K_ref)``; with it, a badly conditioned linear loses more per bit at low K.

:mod:`engine.convert.allocation` then turns the curves into integer bits per linear.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.convert.block_runner import block_device, run_block
from engine.convert.hessians import hessian_hooks
from engine.convert.mse import TRELLIS_MSE
from engine.convert.quantize import incoherence, rotated_hessian


@dataclass
class Sensitivity:
    """One linear's measured cost of quantization at ``k_ref``, and the curve over K."""

    key: str
    weights: int  # in_features * out_features
    k_ref: int
    error: float  # e_l(k_ref): relative squared error of the block output, mean over tokens
    proxies: dict[int, float]  # predicted relative proxy error tr(E H E^T) / tr(W H W^T) per K
    error_global: float = 0.0  # ||y_noisy - y||^2 / ||y||^2 over all tokens (not used)
    output_power: float = 0.0  # mean(y^2) of the block's unquantized output

    @property
    def proxy(self) -> float:
        """The predicted relative proxy error at ``k_ref`` (what the noise was sized by)."""
        return self.proxies[self.k_ref]

    def at(self, k: int) -> float:
        """``e_l(K)``, scaled from the reference K by the predicted proxy error."""
        return self.error * self.proxies[k] / self.proxies[self.k_ref]


# Fixed-point steps for the feedback-inflated strip error (it converges in 2-5 on test problems).
FEEDBACK_ITERATIONS = 8


def ldlq_errors(h: torch.Tensor, lower: torch.Tensor | None, mses: Sequence[float]) -> list[float]:
    """Expected ``tr(E^T H E)`` per output column of LDLQ with the unit block-lower factor
    ``lower`` (None: no feedback), for each encoder MSE (on unit-variance targets) in ``mses``;
    ``h`` is undamped (as the proxy error), ``lower`` from the damped ``h``; unit-RMS targets."""
    h = h.double()
    if lower is None:
        return [mse * float(h.diagonal().sum()) for mse in mses]
    l_inv = unit_lower_inverse(lower)
    return feedback_errors(strip_costs(h, l_inv), [l_inv], mses)


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``L^-1`` of a unit lower-triangular ``lower``, float64. Solved into the identity's own
    buffer (``out=``): the same triangular solve, without a second ``n x n`` float64 buffer."""
    eye = torch.eye(lower.shape[0], dtype=torch.float64, device=lower.device)
    return torch.linalg.solve_triangular(lower.double(), eye, upper=False, unitriangular=True, out=eye)


def strip_costs(h: torch.Tensor, l_inv: torch.Tensor) -> torch.Tensor:
    """``diag(L^-1 H L^-T)``: the cost of each strip error (the product scaled in place: one
    n x n float64 temporary fewer, 1.6 GB for an 8B model's down projection)."""
    return (l_inv @ h.double()).mul_(l_inv).sum(1)


def feedback_errors(weight: torch.Tensor, inverse: list[torch.Tensor], mses: Sequence[float]) -> list[float]:
    """:func:`ldlq_errors` from the strip costs ``weight`` and ``L^-1``, the one item of
    ``inverse`` (taken out, so that it is freed once the feedback gain is formed)."""
    l_inv = inverse.pop()
    # Feedback: strip target error = (I - L^-T) eta; formed in the identity's buffer, in place
    # (the same elementwise difference as ``eye - l_inv.T``, in the same row-major layout).
    gain = torch.eye(l_inv.shape[0], dtype=torch.float64, device=l_inv.device).sub_(l_inv.T)
    del l_inv
    gain.pow_(2)
    out = []
    for mse in mses:
        v = torch.full_like(weight, mse)
        for _ in range(FEEDBACK_ITERATIONS):
            v = (mse * (1 + gain @ v)).clamp(max=1.0)
        out.append(float((v * weight).sum()))
    return out


def ldlq_error(h: torch.Tensor, lower: torch.Tensor | None, mse: float) -> float:
    """:func:`ldlq_errors` for one MSE."""
    return ldlq_errors(h, lower, [mse])[0]


def predicted_proxies(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    ks,
    *,
    seed: int = 0,
    out_scales: bool = True,
    damping: float = 0.01,
) -> dict[int, tuple[float, float]]:
    """Predicted ``{K: (tr(E H E^T), relative proxy error)}`` of quantizing ``weight`` ``(out,
    in)`` at each K in ``ks`` with LDLQ, for the input second moment ``hessian`` ``(in, in)``.

    Uses the quantizer's own incoherence processing and Hessian rotation (the seed only picks
    the random signs); the relative value is comparable with ``proxy_error``.
    """
    device = hessian.device
    gen = torch.Generator().manual_seed(seed)
    inc = incoherence(weight, gen, out_scales, device)
    inc.w = inc.unit = None  # only the scales are used
    h, lower, damp = rotated_hessian(hessian, inc.su, damping)
    peak = float(inc.su.abs().max()) ** 2  # h was formed with su / max|su|
    svh = torch.where(inc.dead, torch.zeros_like(inc.sv), inc.sv).double()
    columns = float(svh.pow(2).sum()) * peak
    ks = list(ks)
    mses = [TRELLIS_MSE[k] for k in ks]
    # ldlq_errors step by step, each n x n float64 buffer let go as soon as the next exists:
    # at most three at a time (an 8B model's down projection: 1.6 GB each).
    if damp == float("inf"):
        del lower
        errors = ldlq_errors(h, None, mses)
        del h
    else:
        l_inv = unit_lower_inverse(lower)
        del lower
        weight_costs = strip_costs(h, l_inv)
        del h
        inverse = [l_inv]
        del l_inv
        errors = feedback_errors(weight_costs, inverse, mses)
    w = weight.to(device=device, dtype=torch.float64)
    reference = float(((w @ hessian.double()) * w).sum())
    out = {}
    for k, err in zip(ks, errors):
        absolute = columns * err
        out[k] = (absolute, absolute / reference if reference > 0 else 0.0)
    return out


def predicted_proxy(weight: torch.Tensor, hessian: torch.Tensor, k: int, **kwargs) -> tuple[float, float]:
    """:func:`predicted_proxies` at one K."""
    return predicted_proxies(weight, hessian, [k], **kwargs)[k]


def relative_change(
    noisy: torch.Tensor,
    clean: torch.Tensor,
    chunk_rows: int | None = None,
    device: torch.device | None = None,
) -> tuple[float, float]:
    """``(per-token, global)`` relative squared change of block outputs ``(rows, cols, dim)``:
    the mean over tokens of ``||d_t||^2 / ||y_t||^2``, and ``||d||^2 / ||y||^2``.

    ``chunk_rows``: the per-token sums are taken that many rows at a time on ``device`` (default:
    where the outputs are), so the float64 copies are a chunk's, not the outputs' (three of
    2.1 GB for an 8B model's 32 pre-pass rows), and host-held outputs are summed on the GPU.

    The per-token form is the one used: the next block sees each token through an RMSNorm, so
    what matters is each token's error relative to that token. The global ratio is dominated by
    the few tokens with massive activations (SmolLM2's residual RMS jumps ~10x at block 12 from
    a handful of positions), which made every linear past that block look ~100x less sensitive.
    """
    step = chunk_rows or max(clean.shape[0], 1)
    ds, ys = [], []
    for r0 in range(0, clean.shape[0], step):
        a = noisy[r0 : r0 + step].to(device or noisy.device)
        b = clean[r0 : r0 + step].to(device or clean.device)
        ds.append((a.double() - b.double()).pow(2).sum(-1))
        ys.append(b.double().pow(2).sum(-1))
    d, y = (torch.cat(ds), torch.cat(ys)) if len(ds) > 1 else (ds[0], ys[0])
    per_token = float((d / y.clamp_min(1e-300)).mean())
    return per_token, float(d.sum() / y.sum().clamp_min(1e-300))


def calibration_subset(rows: int, wanted: int) -> torch.Tensor:
    """Row indices spread evenly over the calibration rows (text rows first, random-token rows
    last), so the subset keeps both kinds in about the same proportion."""
    if wanted >= rows:
        return torch.arange(rows)
    return torch.linspace(0, rows - 1, max(wanted, 1)).round().long().unique()


def measure_sensitivity(
    blocks: Sequence[nn.Module],
    slots: Sequence[Sequence],
    hidden: torch.Tensor,
    k_ref: int,
    chunk_rows: int,
    ks: Sequence[int] = tuple(range(1, 9)),
    *,
    seed: int = 0,
    out_scales: bool = True,
    damping: float = 0.01,
    log: Callable[[str], None] = print,
    pin: Callable[[torch.Tensor], object] | None = None,
    own_hidden: bool = False,
) -> dict[str, Sensitivity]:
    """Run the pre-pass (module docstring) over ``blocks`` with their
    :class:`~engine.convert.slots.LinearSlot` lists ``slots``, from the embedded calibration rows
    ``hidden`` ``(rows, cols, dim)``.
    ``ks``: the K the curves are predicted at (``k_ref`` is added). Returns one
    :class:`Sensitivity` per linear key; the model is left as it was.

    The block outputs go to buffers like ``hidden`` made once (``pin``, if given, is called on
    each: the converter page-locks host states); with ``own_hidden`` the caller's ``hidden`` is
    one of them (it is overwritten), otherwise it is left as it was."""
    ks = sorted({*ks, k_ref})
    out: dict[str, Sensitivity] = {}
    t_start = time.perf_counter()

    def buffer() -> torch.Tensor:
        t = torch.empty_like(hidden)
        if pin is not None:
            pin(t)
        return t

    caller = hidden
    reference, noisy = buffer(), buffer()
    for i, (block, block_slots) in enumerate(zip(blocks, slots)):
        t0 = time.perf_counter()
        device = block_device(block)
        # A CPU conversion sums the outputs whole, as it always did (its results stay bit for
        # bit); on a GPU a chunk at a time there, wherever the states live.
        chunks = None if device.type == "cpu" else chunk_rows
        hooks, handles = hessian_hooks(block_slots, device)
        try:
            with torch.inference_mode():
                run_block(block, hidden, chunk_rows, out=reference)
        finally:
            for handle in handles:
                handle.remove()
        if chunks is None:
            power = float(reference.double().pow(2).mean())
        else:
            power = sum(
                float(reference[r0 : r0 + chunks].to(device).double().pow(2).sum())
                for r0 in range(0, reference.shape[0], chunks)
            ) / max(reference.numel(), 1)
        for j, s in enumerate(block_slots):
            linear = s.get()
            weight = linear.weight
            h = hooks[s.key].hessian()
            predicted = predicted_proxies(
                weight.detach(),
                h,
                ks,
                seed=seed * 100003 + i * 1009 + j,
                out_scales=out_scales,
                damping=damping,
            )
            trace_h = float(h.diagonal().sum())
            std = (predicted[k_ref][0] / (s.out_features * trace_h)) ** 0.5 if trace_h > 0 else 0.0
            gen = torch.Generator().manual_seed(seed * 7919 + i * 131 + j)
            noise = torch.randn(weight.shape, generator=gen, dtype=torch.float32) * std
            original = weight.detach().clone()
            try:
                # In place under inference mode: works whether or not the loader made the
                # weights inference tensors.
                with torch.inference_mode():
                    weight.add_(noise.to(device=weight.device, dtype=weight.dtype))
                    run_block(block, hidden, chunk_rows, out=noisy)
            finally:
                with torch.inference_mode():
                    weight.copy_(original)
                del original
            error, error_global = relative_change(noisy, reference, chunks, device)
            proxies = {k: rel for k, (_, rel) in predicted.items()}
            out[s.key] = Sensitivity(
                s.key, s.in_features * s.out_features, k_ref, error, proxies, error_global, power
            )
        # The next block sees the unquantized model's activations; its output goes to the buffer
        # that held this block's input (a new one once, when that was the caller's to keep).
        free = hidden if own_hidden or hidden is not caller else buffer()
        hidden, reference = reference, free
        errs = [out[s.key].error for s in block_slots]
        log(
            f" -- sensitivity block {i + 1}/{len(blocks)}: e(K={k_ref}) {min(errs):.2e}..{max(errs):.2e}"
            f"  rms(y)={power**0.5:.3g}  [{time.perf_counter() - t0:.1f} s]"
        )
    log(f" -- sensitivity pre-pass: {len(out)} linears in {time.perf_counter() - t_start:.1f} s")
    return out


__all__ = [
    "Sensitivity",
    "calibration_subset",
    "ldlq_error",
    "ldlq_errors",
    "feedback_errors",
    "strip_costs",
    "unit_lower_inverse",
    "measure_sensitivity",
    "predicted_proxies",
    "predicted_proxy",
    "relative_change",
]
