"""Tune a quantized block's scales against the block's output (scale-only fine-tuning).

LDLQ and the refit (:mod:`engine.convert.refit`) fit each linear on its own, in its own loss
``tr(E^T H E)``. But a block's output also depends on how the linears' errors combine: q and k
errors meet in the softmax, gate and up errors in the gated activation, and every error after the
first changes the inputs of the linears after it. QuIP# and QTIP close that gap by fine-tuning the
continuous parameters of each quantized block against the unquantized block's output; this is the
part of that idea that fits the EXL3 format as it is: the trellis (the bits) stays fixed and only
the stored fp16 scale vectors ``suh`` and ``svh`` move, so the tuned model costs nothing extra to
run and is read by any EXL3 loader.

Each linear becomes a :class:`ScaledCore` for the duration: ``y = ((x * suh') R) * svh' + b`` with
``R = H_in Q H_out`` decoded once and ``suh' = suh * (1 + a)``, ``svh' = svh * (1 + c)``, where
``a`` and ``c`` start at zero and Adam moves them to lower the block output's squared error
against the target (the unquantized block on the same inputs, or the unquantized model's hidden
state there) over random calibration rows. Multipliers rather than the scales themselves keep one
learning rate right for scales of any size. A few held-out rows judge the result: where tuning did
not lower their error, the scales are left as they were.

Measured on SmolLM2-135M (docs/PERFORMANCE.md): the held-out block error falls by 4-8%,
but the model's KL moved by -3% at 4.0 bpw and +0.5% at 3.0, inside one conversion's luck, so the
converter leaves it off unless asked (``convert --tune-steps N``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.convert.quantize import fp16_scale
from engine.exl3.exl3_linear import EXL3Linear
from engine.exl3.hadamard import blockwise_hadamard


@dataclass
class TuneOptions:
    steps: int = 100  # Adam steps per block (0: no tuning)
    rows: int = 4  # calibration rows per step
    lr: float = 1e-3  # on the multipliers' offsets a, c
    held_out: int = 4  # rows kept out of training that judge the result
    seed: int = 0


@dataclass
class TuneResult:
    """A block's relative squared output error on the held-out rows before and after."""

    before: float
    after: float
    kept: bool  # False: tuning did not help on the held-out rows; the scales were left alone
    seconds: float


class ScaledCore(nn.Module):
    """A quantized linear with its decoded core fixed and its scales learnable (see module doc)."""

    def __init__(self, linear: EXL3Linear) -> None:
        """From ``linear`` in streaming mode (the mode that keeps the trellis and the scales)."""
        super().__init__()
        n_in, n_out = linear.in_features, linear.out_features
        core = blockwise_hadamard(blockwise_hadamard(linear.inner_weight().float(), 0), 1)
        self.register_buffer("core", core[:n_in, :n_out].contiguous())
        self.register_buffer("suh", linear.suh[:n_in].float())
        self.register_buffer("svh", linear.svh[:n_out].float())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.float())
        self.a = nn.Parameter(torch.zeros(n_in, device=core.device))
        self.c = nn.Parameter(torch.zeros(n_out, device=core.device))
        self.in_features, self.out_features = n_in, n_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ((x.float() * (self.suh * (1 + self.a))) @ self.core) * (self.svh * (1 + self.c))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def scales(self, suh: torch.Tensor, svh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored (padded, fp16) ``suh`` and ``svh`` with the learnt multipliers applied."""
        suh, svh = suh.clone(), svh.clone()
        with torch.no_grad():
            suh[: self.in_features] = fp16_scale(self.suh * (1 + self.a))
            svh[: self.out_features] = fp16_scale(self.svh * (1 + self.c))
        return suh, svh

    def round_to_storage(self) -> None:
        """Snap the multipliers to what fp16 storage will hold, so the held-out verdict is the
        stored model's."""
        with torch.no_grad():
            for scale, mult in ((self.suh, self.a), (self.svh, self.c)):
                stored = fp16_scale(scale * (1 + mult)).float()
                mult.copy_(torch.where(scale != 0, stored / scale - 1, torch.zeros_like(mult)))


Block = Callable[[torch.Tensor], torch.Tensor]


def make_trainable(module: nn.Module) -> None:
    """Replace ``module``'s parameters and buffers made under ``torch.inference_mode`` (a model
    loaded for inference) by ordinary copies: autograd may not save inference tensors, and the
    norms save their weights for the backward pass."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_inference():
                sub._parameters[name] = nn.Parameter(p.clone(), requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_inference():
                sub._buffers[name] = b.clone()


def _relative_error(
    run: Block, hidden: torch.Tensor, target: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    out = run(hidden[rows])
    ref = target[rows].to(out.device)  # the states may be kept on the host
    return (out.float() - ref.float()).pow(2).sum() / ref.float().pow(2).sum()


def tune_block_scales(
    run: Block,
    layers: Sequence[ScaledCore],
    hidden: torch.Tensor,
    target: torch.Tensor,
    options: TuneOptions,
) -> TuneResult:
    """Tune ``layers``' multipliers so that ``run(hidden[rows])`` (the block, with ``layers`` in
    place of its linears) approaches ``target[rows]``. ``hidden`` and ``target`` are
    ``(rows, cols, dim)``. On return the multipliers hold the result (zero where not kept)."""
    t0 = time.perf_counter()
    n = hidden.shape[0]
    gen = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(n, generator=gen)
    held = min(options.held_out, max(1, n // 4))
    judge, train = order[:held].to(hidden.device), order[held:]
    params = [p for layer in layers for p in (layer.a, layer.c)]
    with torch.no_grad():
        before = float(_relative_error(run, hidden, target, judge))
    opt = torch.optim.Adam(params, lr=options.lr)
    for _ in range(options.steps):
        pick = train[torch.randint(0, train.numel(), (min(options.rows, train.numel()),), generator=gen)]
        opt.zero_grad(set_to_none=True)
        loss = _relative_error(run, hidden, target, pick.to(hidden.device))
        loss.backward()
        opt.step()
    for layer in layers:
        layer.round_to_storage()
    with torch.no_grad():
        after = float(_relative_error(run, hidden, target, judge))
    kept = after < before
    if not kept:
        with torch.no_grad():
            for p in params:
                p.zero_()
    return TuneResult(before, after, kept, time.perf_counter() - t0)


__all__ = ["ScaledCore", "make_trainable", "TuneOptions", "TuneResult", "tune_block_scales"]
