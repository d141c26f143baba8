"""One decoder block's linears quantized, in place.

While the *unquantized* block runs over the calibration rows, its linears record their input
Hessians (:mod:`engine.convert.hessians`); each linear is then quantized
(:func:`engine.convert.quantize.quantize_weights`, lockstep groups of them at a time) and swapped
for an :class:`~engine.exl3.exl3_linear.EXL3Linear` built from the very tensors the output stores.
With ``sequential`` each input group's Hessian is captured again once the linears before it in
the block are quantized. With ``tune_steps`` the quantized block's scales are then tuned to the
unquantized output (:mod:`engine.convert.finetune`).

Mixture of experts: every expert's gate/up/down is an ordinary linear here, keyed one per expert,
and quantized with the Hessian of the calibration tokens the unquantized router sent it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.convert.block_runner import forward_rows, run_block
from engine.convert.finetune import ScaledCore, TuneOptions, make_trainable, tune_block_scales
from engine.convert.hessians import HessianHook, capture_hessians, hessian_hooks, input_groups
from engine.convert.options import ConvertOptions
from engine.convert.quantize import QuantizedTensors, WeightJob, quantize_weights, stored_tensor_count
from engine.convert.sensitivity import Sensitivity
from engine.convert.slots import LinearSlot
from engine.exl3.exl3_linear import EXL3Linear

# Linears of one block are encoded in lockstep (engine.convert.quantize.ldlq_many) up to this many
# weights at once: small strips leave a GPU mostly idle, large ones fill it alone, and every linear
# in flight holds a few float32 copies of itself.
LOCKSTEP_WEIGHTS = 64 << 20


def quantize_block(
    block: nn.Module,
    slots: list[LinearSlot],
    hidden: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor | None,
    sensitivities: dict[str, Sensitivity],
    options: ConvertOptions,
    index: int,
    chunk_rows: int,
    device: torch.device,
    log: Callable[[str], None],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Quantize block ``index``'s linears ``slots`` with Hessians of its inputs ``hidden`` (the
    quantized model's state there), swapping each for its EXL3 linear. ``reference`` (a buffer
    like ``hidden``) receives the unquantized block's output; the tuning aims at it, or at
    ``exact`` (the unquantized model's state) when given. Returns the block's stored tensors and
    its log lines (the pre-pass's prediction beside each linear's proxy error)."""
    # Without ``sequential`` one forward of the unquantized block gives every Hessian; with it,
    # each input group after the first is captured again once the groups before it are
    # quantized, so its Hessian is that of the inputs it will see at inference.
    stages = input_groups(slots) if options.sequential else [slots]
    hooks, handles = hessian_hooks(stages[0], device)
    with torch.inference_mode():
        run_block(block, hidden, chunk_rows, out=reference)
    for h in handles:
        h.remove()
    tensors: dict[str, torch.Tensor] = {}
    lines = []
    for j, stage in enumerate(stages):
        if j > 0:
            hooks = capture_hessians(block, hidden, stage, chunk_rows)
        lines += quantize_stage(stage, hooks, tensors, sensitivities, options, index, device, log)
    if options.tune_steps > 0:
        target = reference if exact is None else exact
        lines.append(tune_block(block, slots, tensors, hidden, target, options, index))
    return tensors, lines


def quantize_stage(
    slots: list[LinearSlot],
    hooks: dict[str, HessianHook],
    block_tensors: dict[str, torch.Tensor],
    sensitivities: dict[str, Sensitivity],
    options: ConvertOptions,
    index: int,
    device: torch.device,
    log: Callable[[str], None],
) -> list[str]:
    """Quantize ``slots`` (lockstep groups of them at a time) with their captured Hessians, swap
    each for its :class:`EXL3Linear`, add its tensors to ``block_tensors`` and return the log
    lines. A linear's seed counts the block's tensors stored before it, so it is the same however
    the block's linears are staged."""
    lines = []
    for group in lockstep_groups(slots):
        jobs = []
        stored = len(block_tensors)
        for s in group:
            dense = s.get()
            jobs.append(
                WeightJob(
                    dense.weight.detach(),
                    hooks[s.key].hessian(),
                    s.bits,
                    seed=options.seed * 100003 + stored + index * 1009,
                    warn=lambda msg, key=s.key: log(f"    warning: {key}: {msg}"),
                )
            )
            stored += stored_tensor_count(options.codebook, getattr(dense, "bias", None) is not None)
        results = quantize_weights(
            jobs,
            options.codebook,
            out_scales=options.out_scales,
            damping=options.damping,
            refit=options.refit,
            device=device,
        )
        for s, qt in zip(group, results):
            bias = getattr(s.get(), "bias", None)
            tensors = qt.tensors(s.key, bias.detach() if bias is not None else None)
            block_tensors.update(tensors)
            install_quantized([s], tensors)
            line = f"    {s.key:48s} K={s.bits}  proxy_err={qt.proxy_error:.6f}  scale={qt.scale:.4f}"
            if s.key in sensitivities:  # the pre-pass's figures at this K, for comparison
                sens = sensitivities[s.key]
                line += f"  predicted={sens.proxies[s.bits]:.6f}  e={sens.at(s.bits):.2e}"
            lines.append(line + refit_note(qt))
    return lines


def lockstep_groups(slots: list[LinearSlot]) -> list[list[LinearSlot]]:
    """Consecutive runs of ``slots`` of at most :data:`LOCKSTEP_WEIGHTS` weights (a larger linear
    alone)."""
    groups: list[list[LinearSlot]] = []
    size = 0
    for s in slots:
        n = s.in_features * s.out_features
        if groups and size + n <= LOCKSTEP_WEIGHTS:
            groups[-1].append(s)
            size += n
        else:
            groups.append([s])
            size = n
    return groups


def tune_block(
    block: nn.Module,
    slots: list[LinearSlot],
    tensors: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    reference: torch.Tensor,
    options: ConvertOptions,
    index: int,
) -> str:
    """Tune the quantized block's scales to its unquantized output (:mod:`engine.convert.finetune`),
    update ``tensors`` and the block's linears, and return the log line."""
    layers = []
    for s in slots:
        sub = linear_tensors(tensors, s.key)
        layers.append(
            ScaledCore(EXL3Linear.from_tensors(sub, s.in_features, s.out_features, None, "streaming"))
        )
        s.set(layers[-1])
    make_trainable(block)
    tune = TuneOptions(steps=options.tune_steps, lr=options.tune_lr, seed=options.seed * 7919 + index)
    result = tune_block_scales(tuning_runner(block), layers, hidden, reference, tune)
    for s, layer in zip(slots, layers):
        suh, svh = layer.scales(tensors[f"{s.key}.suh"], tensors[f"{s.key}.svh"])
        tensors[f"{s.key}.suh"], tensors[f"{s.key}.svh"] = suh, svh
        install_quantized([s], tensors)
    verdict = "kept" if result.kept else "not kept"
    return (
        f"    scale tuning: held-out error {result.before:.3e} -> {result.after:.3e} ({verdict}, "
        f"{options.tune_steps} steps, {result.seconds:.1f} s)"
    )


def tuning_runner(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The block as :func:`~engine.convert.finetune.tune_block_scales` runs it: rows in, output left
    on the block's device (:func:`forward_rows`), so the loss and its backward run there whether
    the states live on the host or the device: the same rounding either way (and GPU speed)."""
    return lambda rows: forward_rows(block, rows)


def install_quantized(slots: list[LinearSlot], tensors: dict[str, torch.Tensor]) -> None:
    """Put each slot's :class:`EXL3Linear`, built from its stored tensors among ``tensors``, in
    the block in place of what is there (the dense linear, or a tuned one)."""
    for s in slots:
        sub = linear_tensors(tensors, s.key)
        s.set(EXL3Linear.from_tensors(sub, s.in_features, s.out_features, None, name=s.key))


def linear_tensors(tensors: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """The stored tensors of the linear ``key`` among ``tensors`` (full names, as stored)."""
    return {k: v for k, v in tensors.items() if k.startswith(key + ".")}


def refit_note(qt: QuantizedTensors) -> str:
    """The scale refit's loss before -> after for a linear's log line ('' when it did not run)."""
    return "" if qt.refit is None else f"  refit {qt.refit.before:.6f}->{qt.refit.after:.6f}"


__all__ = [
    "LOCKSTEP_WEIGHTS",
    "install_quantized",
    "linear_tensors",
    "lockstep_groups",
    "quantize_block",
    "quantize_stage",
    "refit_note",
    "tune_block",
    "tuning_runner",
]
