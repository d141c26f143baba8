"""``--gpu-layers N``: the first N decoder layers on the GPU, the rest on the CPU.

A front end to the layer split (``engine.parallel.placement``): it is ``--split-layers N,REST``
over (GPU, CPU), loaded so that the GPU never holds more than its part. The model is read into
host memory in the GPU's dtype; the embedding, final norm, head (and a vision tower) and the first
N layers are then moved to the GPU, and :func:`~engine.parallel.placement.split_layers` places the
rest as it places any split. Where a model would not fit the GPU whole, this is how it runs at all:
each layer on the CPU costs its compute there, so N as large as the GPU holds is the fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.errors import UsageError
from engine.model import LoadedModel, default_dtype, load_model
from engine.options import EngineOptions
from engine.parallel.placement import own_rotaries, split_layers

HOST = torch.device("cpu")


def gpu_layer_counts(n: int, num_layers: int) -> list[int]:
    """``--gpu-layers n`` as the layer counts of its split: ``[n, num_layers - n]``."""
    if not 0 <= n <= num_layers:
        raise UsageError(
            f"--gpu-layers {n} is out of range: the model has {num_layers} layers (0..{num_layers})"
        )
    return [n, num_layers - n]


def the_gpu() -> torch.device:
    """The GPU the first layers go to (GPU 0), or a UsageError where there is none."""
    if not torch.cuda.is_available():
        raise UsageError(
            "--gpu-layers needs a GPU and none was found (without one every layer runs on the CPU)"
        )
    return torch.device("cuda", 0)


def load_gpu_layers(
    directory: str | Path,
    n: int,
    gpu: torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    context: int | None = None,
    options: EngineOptions | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> LoadedModel:
    """The model of ``directory`` with its first ``n`` layers on ``gpu`` (default
    :func:`the_gpu`; tests pass another device) and the rest on the CPU."""
    gpu = the_gpu() if gpu is None else torch.device(gpu)
    model = load_model(
        directory,
        device="cpu",
        dtype=dtype or default_dtype(gpu),
        context=context,
        progress=progress,
        options=options,
    )
    counts = gpu_layer_counts(n, len(model.module.blocks))
    return split_layers(move_front(model, n, gpu), counts, [gpu, HOST])


def move_front(model: LoadedModel, n: int, device: torch.device) -> LoadedModel:
    """``model`` (in host memory) with everything but its layers from ``n`` on moved to
    ``device``, which becomes the model's device (in place for the module)."""
    blocks = model.module.blocks
    kept = list(blocks[n:])
    copies: dict = {}
    for block in kept:  # rotary tables shared with the moving layers: a host copy of their own
        own_rotaries(block, HOST, copies)
    del blocks[n:]  # out of the module while it moves, so they stay where they are
    try:
        model.module.to(device)
    finally:
        blocks.extend(kept)
    vision = model.vision.to(device) if model.vision is not None else None
    return replace(model, device=device, vision=vision)
