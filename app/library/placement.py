"""Where a model runs, in words: the automatic choice for the selected model (all on the GPU, its
layers split across several GPUs, its experts in system memory, or its first layers on the GPU)
with the line saying why, and the memory estimate of a choice split between the GPU and system
memory (``engine.placement_memory``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import UsageError
from engine.inspect import ModelInfo
from engine.parallel.auto_split import CPU, plan_split
from engine.placement_memory import MemorySplit, memory_split, suggest_placement
from engine.units import format_bytes

# The layer split the engine chooses by each GPU's free memory (``--split-layers auto``).
SPLIT = "split"


@dataclass(frozen=True)
class PlacementAdvice:
    """The choice for a model and why (``reason`` empty where it fits the GPU whole)."""

    placement: str
    gpu_layers: int | None
    reason: str


def advise(
    info: ModelInfo,
    context: int,
    cache_bits: tuple[int, int],
    gpu_bytes: int,
    free: bool = False,
    more_gpus: Sequence[int] = (),
) -> PlacementAdvice:
    """Where ``info``'s model should run on a GPU of ``gpu_bytes`` (its free memory where ``free``,
    else its size), with ``more_gpus`` the bytes of the GPUs after it: split across them where it
    does not fit the first and they hold it together."""
    suggestion = suggest_placement(info, context, cache_bits, gpu_bytes)
    if suggestion.placement == "gpu":
        return PlacementAdvice("gpu", None, "")
    need, have = format_bytes(suggestion.needed.gpu_bytes), format_bytes(gpu_bytes)
    why = (
        f"Chosen because {info.name} needs ≈ {need} all on the GPU, which has {have}{' free' if free else ''}"
    )
    if more_gpus and fits_gpus(info, context, cache_bits, [gpu_bytes, *more_gpus]):
        return PlacementAdvice(
            SPLIT, None, f"{why}: its layers are split across the {1 + len(more_gpus)} GPUs."
        )
    if suggestion.placement == "experts":
        return PlacementAdvice("experts", None, f"{why}: its experts stay in system memory.")
    n, layers = suggestion.gpu_layers or 0, info.num_layers or 0
    return PlacementAdvice("layers", n, f"{why}: its first {n} of {layers} layers fit there.")


def fits_gpus(info: ModelInfo, context: int, cache_bits: tuple[int, int], gpus: Sequence[int]) -> bool:
    """Whether the engine's automatic layer split over GPUs with ``gpus`` bytes free leaves
    nothing to the CPU."""
    try:
        plan = plan_split(info, context, cache_bits, [(f"cuda:{i}", b) for i, b in enumerate(gpus)])
    except UsageError:  # the first GPU cannot hold the embedding, or the layer count is unknown
        return False
    return CPU not in plan.devices


def split_text(split: MemorySplit) -> str:
    """E.g. "GPU ≈ 7.2 GiB + system memory ≈ 41.0 GiB"."""
    return f"GPU ≈ {format_bytes(split.gpu_bytes)} + system memory ≈ {format_bytes(split.host_bytes)}"


def estimate_split(
    info: ModelInfo, context: int, cache_bits: tuple[int, int], placement: str, gpu_layers: int | None
) -> MemorySplit | None:
    """The GPU and system-memory parts of running ``info``'s model as chosen; None for all on the
    GPU or across the GPUs (one figure says it)."""
    if placement in ("gpu", SPLIT):
        return None
    return memory_split(info, context, cache_bits, placement, gpu_layers)
