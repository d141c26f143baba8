"""Loading a model with ``--split-layers auto``: each GPU's free memory from torch, the split
from ``engine.parallel.auto_split``, then the layer split of ``engine.parallel.placement``.

A split model's layers are read straight onto their devices (``placement.load_split``, as
``--gpu-layers`` does): no GPU ever holds more than its part, which is the point of splitting a
model that one card cannot hold. A model that fits the first GPU loads there plainly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from engine.inspect import inspect_model, system_memory
from engine.model import LoadedModel, load_model
from engine.options import EngineOptions
from engine.parallel.auto_split import SplitPlan, plan_split
from engine.parallel.placement import load_split


def free_gpu_memory() -> list[tuple[str, int]]:
    """``(device, free bytes)`` of every GPU torch sees, in order (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [(f"cuda:{i}", int(torch.cuda.mem_get_info(i)[0])) for i in range(torch.cuda.device_count())]


def available_host_memory() -> int:
    """Bytes of system memory available now (0: unknown)."""
    return system_memory()[0]


def report_to_stderr(line: str) -> None:
    print(f"trellis: split-layers auto: {line}", file=sys.stderr)


def auto_split_plan(
    directory: str | Path, context: int | None = None, cache_bits: tuple[int, int] = (16, 16)
) -> SplitPlan:
    """The automatic split of the model in ``directory`` over this machine's GPUs and CPU now."""
    info = inspect_model(directory)
    return plan_split(info, context, cache_bits, free_gpu_memory(), available_host_memory())


def load_auto_split(
    directory: str | Path,
    dtype: str | torch.dtype | None = None,
    context: int | None = None,
    cache_bits: tuple[int, int] = (16, 16),
    options: EngineOptions | None = None,
    progress: Callable[[float, str], None] | None = None,
    report: Callable[[str], None] | None = report_to_stderr,
) -> LoadedModel:
    """The model of ``directory`` split over the GPUs by their free memory, the rest on the CPU;
    ``context``: the cache's tokens (None: the Generator's default) and the RoPE context, as for
    :func:`~engine.model.load_model`. ``report`` gets the chosen split in one line."""
    plan = auto_split_plan(directory, context, cache_bits)
    if report is not None:
        report(plan.describe())
    devices = [torch.device(d) for d in plan.devices]
    home = devices[0]
    if not plan.is_split:
        return load_model(
            directory, device=str(home), dtype=dtype, context=context, progress=progress, options=options
        )
    return load_split(directory, plan.counts, devices, dtype, context, options, progress)
