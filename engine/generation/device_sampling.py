"""Where a batch's tokens are drawn: the argmax, the device sampler, or the host.

The GPU sampler (``ext/sampling.cu``, through :func:`engine.kernels.sampling.sample_tokens`)
applies the processors of :mod:`engine.generation.sampling` whose ``device`` flag is set, in one
launch over the raw logits, and hands back a few bytes per row. :func:`sampling_path` routes a batch there
only when every processor active in any of its rows is one the kernel applies; otherwise the rows
are drawn on the host by the same reference the kernel is tested against (the module docstring
of :mod:`engine.generation.sampling` says why all or nothing).

The kernel's inputs and its torch reference are defined in :mod:`engine.generation.sampling` (one
definition for the host and the device); they are importable from here too, where the kernel's
callers (``engine.kernels.sampling``, its benchmarks and tests) look for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from engine.generation.sampling import (
    SETTING_FIELDS,
    WEIGHT_SCALE,
    SamplingRows,
    SamplingSettings,
    active_processors,
    apply_penalties_rows,
    pack_rows,
    sample_reference,
)

__all__ = [
    "SETTING_FIELDS",
    "WEIGHT_SCALE",
    "SamplingRows",
    "apply_penalties_rows",
    "pack_rows",
    "sample_reference",
    "sampling_path",
]

Path = Literal["argmax", "device", "host"]


def sampling_path(
    settings: Sequence[SamplingSettings],
    constrained: Sequence[bool] | None = None,
    device_sampling: bool = True,
) -> Path:
    """How a step's rows (one per job: its ``settings``, and whether it has a constraint) get
    their tokens: ``"argmax"`` when no row has an active processor (plain greedy: the argmax of
    the raw logits, wherever they are); ``"device"`` when ``device_sampling`` is on and the
    kernel applies every active processor of every row
    (:func:`engine.kernels.sampling.sample_tokens` on a GPU, the reference elsewhere); else
    ``"host"``: each row by the reference on the host (``Sampler.sample``)."""
    constrained = constrained if constrained is not None else [False] * len(settings)
    active = [p for s, c in zip(settings, constrained, strict=True) for p in active_processors(s, c)]
    if not active:
        return "argmax"
    if device_sampling and all(p.device for p in active):
        return "device"
    return "host"
