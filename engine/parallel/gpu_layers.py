"""``--gpu-layers N``: the first N decoder layers on the GPU, the rest on the CPU.

A front end to the layer split (``engine.parallel.placement``): it is ``--split-layers N,REST``
over (GPU, CPU), loaded by :func:`~engine.parallel.placement.load_split`: the embedding, final
norm, head (and a vision tower) and the first N layers are read onto the GPU, the rest into host
memory, so the GPU never holds more than its part. Where a model would not fit the GPU whole, this
is how it runs at all: each layer on the CPU costs its compute there, so N as large as the GPU
holds is the fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.errors import UsageError
from engine.model import LoadedModel
from engine.options import EngineOptions
from engine.parallel.placement import load_split, model_layer_count

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
    counts = gpu_layer_counts(n, model_layer_count(directory))
    return load_split(directory, counts, [gpu, HOST], dtype, context, options, progress)
