"""The bits every linear gets in one conversion: how they are chosen, and kept for a resume.

``allocation="sensitivity"`` (the default): a pre-pass over a subset of the calibration rows
measures what quantizing each linear alone costs its block (:mod:`engine.convert.sensitivity`), and
a greedy knapsack spends the bit budget where it lowers that cost most
(:func:`engine.convert.allocation.greedy_bits`). ``allocation="uniform"``: every linear gets
``floor(bits)`` and the fractional extra bits go by a fixed kind priority
(:func:`engine.convert.allocation.allocate_bits`).

The choice is written to the work directory (``allocation.json``) before any block is quantized;
a resumed job reads it back, so it neither redoes the pre-pass nor disagrees with the blocks
already written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from engine.convert.allocation import achieved_bits, allocate_bits, bits_histogram, greedy_bits, k_range
from engine.convert.checkpoints import ALLOCATION_FILE
from engine.convert.host_states import HostPins
from engine.convert.options import ConvertOptions
from engine.convert.sensitivity import Sensitivity, calibration_subset, measure_sensitivity
from engine.convert.slots import LinearSlot


def plan_bits(
    blocks: Sequence[nn.Module],
    per_block: list[list[LinearSlot]],
    hidden: torch.Tensor,
    chunk_rows: int,
    options: ConvertOptions,
    work: Path,
    log: Callable[[str], None],
    device: torch.device | None = None,
) -> tuple[float, dict[str, Sensitivity]]:
    """Set ``bits`` on every slot by ``options.allocation`` (or as the job's ``allocation.json``
    in ``work`` says) and log the result; returns the achieved bits per weight and the
    sensitivities by key (empty for ``uniform`` or when the bits come from an earlier run).
    ``hidden``: the embedded calibration rows; the pre-pass runs on a copy of a subset of them."""
    all_slots = [s for slots in per_block for s in slots]
    saved = work / ALLOCATION_FILE
    sensitivities: dict[str, Sensitivity] = {}
    if saved.is_file():  # a resumed job (job.json matched): reuse the bits it wrote blocks with
        bits = json.loads(saved.read_text())["bits"]
        for s in all_slots:
            s.bits = int(bits[s.key])
        how = "from " + saved.name
    elif options.allocation == "uniform":
        allocate_bits(all_slots, options.bits)
        how = "uniform"
    else:
        lo, hi = k_range(options.bits)
        k_ref = min(max(int(math.floor(options.bits)), lo), hi)
        rows = calibration_subset(hidden.shape[0], options.sensitivity_rows).to(hidden.device)
        log(f" -- sensitivity pre-pass: {len(rows)} rows, K_ref={k_ref}, K in {lo}..{hi}")
        # The subset is the pre-pass's own copy (it may overwrite it); with host states, it and
        # the pre-pass's buffers are page-locked while it runs (HostPins).
        with HostPins(device or hidden.device, log) as pins:
            subset = hidden.index_select(0, rows)
            pins.pin(subset)
            sensitivities = measure_sensitivity(
                blocks,
                per_block,
                subset,
                k_ref,
                chunk_rows,
                range(lo, hi + 1),
                seed=options.seed,
                out_scales=options.out_scales,
                damping=options.damping,
                log=log,
                pin=pins.pin,
                own_hidden=True,
            )
            del subset
        sens = [sensitivities[s.key] for s in all_slots]
        chosen = greedy_bits([x.weights for x in sens], [x.at for x in sens], options.bits)
        for s, k in zip(all_slots, chosen):
            s.bits = k
        how = "sensitivity"
    saved.write_text(json.dumps({"allocation": how, "bits": {s.key: s.bits for s in all_slots}}, indent=1))
    achieved = achieved_bits([s.in_features * s.out_features for s in all_slots], [s.bits for s in all_slots])
    log(
        f" -- bit allocation ({how}): {achieved:.2f} bits/weight, {len(all_slots)} linears "
        f"(target {options.bits}); {bits_histogram([s.bits for s in all_slots])}"
    )
    by_kind: dict[str, list[int]] = {}
    for s in all_slots:
        by_kind.setdefault(s.kind, []).append(s.bits)
    log("    mean K by kind: " + "  ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in by_kind.items()))
    return achieved, sensitivities


__all__ = ["plan_bits"]
