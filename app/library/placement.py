"""Where a model runs, in words: the automatic choice for the selected model (all on the GPU, its
experts in system memory, or its first layers on the GPU) with the line saying why, and the memory
estimate of a choice split between the GPU and system memory (``engine.placement_memory``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.inspect import ModelInfo
from engine.placement_memory import MemorySplit, memory_split, suggest_placement
from engine.units import format_bytes


@dataclass(frozen=True)
class PlacementAdvice:
    """The choice for a model and why (``reason`` empty where it fits the GPU whole)."""

    placement: str
    gpu_layers: int | None
    reason: str


def advise(info: ModelInfo, context: int, cache_bits: tuple[int, int], gpu_bytes: int) -> PlacementAdvice:
    """Where ``info``'s model should run on a GPU of ``gpu_bytes``."""
    suggestion = suggest_placement(info, context, cache_bits, gpu_bytes)
    if suggestion.placement == "gpu":
        return PlacementAdvice("gpu", None, "")
    need, have = format_bytes(suggestion.needed.gpu_bytes), format_bytes(gpu_bytes)
    why = f"Chosen because {info.name} needs ≈ {need} all on the GPU, which has {have}"
    if suggestion.placement == "experts":
        return PlacementAdvice("experts", None, f"{why}: its experts stay in system memory.")
    n, layers = suggestion.gpu_layers or 0, info.num_layers or 0
    return PlacementAdvice("layers", n, f"{why}: its first {n} of {layers} layers fit there.")


def split_text(split: MemorySplit) -> str:
    """E.g. "GPU ≈ 7.2 GiB + system memory ≈ 41.0 GiB"."""
    return f"GPU ≈ {format_bytes(split.gpu_bytes)} + system memory ≈ {format_bytes(split.host_bytes)}"


def estimate_split(
    info: ModelInfo, context: int, cache_bits: tuple[int, int], placement: str, gpu_layers: int | None
) -> MemorySplit | None:
    """The GPU and system-memory parts of running ``info``'s model as chosen; None for all on the
    GPU (one figure says it)."""
    if placement == "gpu":
        return None
    return memory_split(info, context, cache_bits, placement, gpu_layers)
