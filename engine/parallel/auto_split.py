"""``--split-layers auto``: how many consecutive layers each GPU takes, from its free memory.

The GPUs are filled in order: the first takes the embedding, final norm and head, then as many
layers as its free memory holds; the next GPU continues from the next layer; whatever the GPUs
cannot hold stays in system memory, run by the CPU. A model that fits the first GPU is not split.
The pieces' sizes come from the library's estimate (``engine.placement_memory.layer_bytes``).

Torch-free, like the estimate: the app asks it whether a model fits its GPUs together, and the
loader (``engine.parallel.auto_loading``) gives it the free memory torch reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import UsageError
from engine.inspect import ModelInfo
from engine.placement_memory import layer_bytes
from engine.units import format_bytes

AUTO = "auto"

# Kept free on every GPU beyond the estimate: the estimate covers weights, cache, activations and
# allocator slack of the model itself, not what a process adds on each card it runs on: the
# extension's kernel images and cuBLAS workspaces (hundreds of MiB per device), prefill scratch
# that a step allocates and frees (a chunk's MLP intermediates reach hundreds of MiB on large
# models), CUDA graph pools on an unsplit card, and the caching allocator's fragmentation, which
# grows with the card. 1 GiB, or 5% of the free memory on a large card.
GPU_MARGIN_BYTES = 1 << 30
GPU_MARGIN_RATIO = 0.05
# Kept free in system memory: the process itself (Python, tokenizer, the loader's buffers) and
# the operating system's own working set.
HOST_MARGIN_BYTES = 2 << 30
# The cache the Generator allocates where a caller gives no size (engine.generation.generator).
DEFAULT_CACHE_TOKENS = 8192
CPU = "cpu"


def is_auto(text: str | None) -> bool:
    """Whether a ``--split-layers`` value asks for the automatic split."""
    return text is not None and text.strip().lower() == AUTO


def usable_bytes(free: int) -> int:
    """What a layer split may fill of a GPU with ``free`` bytes free (see the margin above)."""
    return max(0, int(free) - max(GPU_MARGIN_BYTES, int(free * GPU_MARGIN_RATIO)))


def host_budget(available: int) -> int | None:
    """What a layer split may fill of ``available`` bytes of system memory (None: unknown)."""
    return max(0, int(available) - HOST_MARGIN_BYTES) if available > 0 else None


def auto_layer_counts(
    gpu_bytes: Sequence[int],
    layers: Sequence[int],
    front: int = 0,
    host_bytes: int | None = None,
    host_layers: Sequence[int] | None = None,
) -> list[int]:
    """Layers per GPU in order, then the CPU's: ``counts[i]`` consecutive layers on GPU i (of
    ``gpu_bytes[i]`` usable bytes), ``counts[-1]`` on the CPU.

    ``layers[i]``: layer i's bytes on a GPU, ``host_layers[i]`` in system memory (default the
    same); ``front``: what the first device holds besides its layers. ``host_bytes``: system
    memory the CPU's layers may use (None: unknown, not checked). Without a GPU every layer is the
    CPU's. A UsageError says what does not fit."""
    host_layers = list(layers if host_layers is None else host_layers)
    if len(host_layers) != len(layers):
        raise ValueError(f"{len(host_layers)} host sizes for {len(layers)} layers")
    counts: list[int] = []
    on_host = front if not gpu_bytes else 0
    if gpu_bytes and gpu_bytes[0] < front:
        raise UsageError(
            f"the first GPU has {format_bytes(gpu_bytes[0])} to spare, less than the embedding and "
            f"head need (≈ {format_bytes(front)}): free memory on it, or give --split-layers counts"
        )
    layer = 0
    for i, budget in enumerate(gpu_bytes):
        room, count = budget - (front if i == 0 else 0), 0
        while layer < len(layers) and layers[layer] <= room:
            room -= layers[layer]
            layer, count = layer + 1, count + 1
        counts.append(count)
    on_host += sum(host_layers[layer:])
    if host_bytes is not None and on_host > host_bytes:
        gpus = f"the GPUs hold {layer} of {len(layers)} layers" if gpu_bytes else "there is no GPU"
        raise UsageError(
            f"the model does not fit: {gpus}, and the rest needs ≈ {format_bytes(on_host)} of "
            f"system memory, which has {format_bytes(host_bytes)} to spare"
        )
    counts.append(len(layers) - layer)
    return counts


@dataclass(frozen=True)
class SplitPlan:
    """An automatic split: ``counts[i]`` consecutive layers on ``devices[i]`` (``"cuda:0"``,
    ``"cpu"``), which had ``free[i]`` bytes free (0 for the CPU). Parts without layers are left
    out, except the first device, which holds the embedding and head."""

    devices: tuple[str, ...]
    counts: tuple[int, ...]
    free: tuple[int, ...]

    @property
    def is_split(self) -> bool:
        """Whether more than one device takes part (else the model loads plainly there)."""
        return len(self.devices) > 1

    def describe(self) -> str:
        """E.g. "layers 0-27 on cuda:0 (21.3 GiB free), 28-39 on cuda:1 (11.0 GiB free), 40-47
        on the CPU"."""
        places = [
            "the CPU" if device == CPU else f"{device} ({format_bytes(free)} free)"
            for device, free in zip(self.devices, self.free)
        ]
        spans, start = [], 0
        for place, count in zip(places, self.counts):
            if count:
                spans.append(
                    f"{start}-{start + count - 1} on {place}" if count > 1 else f"{start} on {place}"
                )
            start += count
        text = "layers " + ", ".join(spans)
        return text if self.counts[0] else f"embedding and head on {places[0]}, {text}"


def plan_split(
    info: ModelInfo,
    context: int | None,
    cache_bits: tuple[int, int],
    gpus: Sequence[tuple[str, int]],
    host_available: int = 0,
) -> SplitPlan:
    """The automatic split of ``info``'s model for ``context`` tokens of cache (None: the
    Generator's default) over ``gpus`` (each ``(device, free bytes)``, in order) and the CPU with
    ``host_available`` bytes of system memory available (0: unknown)."""
    if not info.num_layers:
        raise UsageError(f"--split-layers auto needs the layer count of {info.name} (config.json)")
    tokens = context or min(info.context_length or DEFAULT_CACHE_TOKENS, DEFAULT_CACHE_TOKENS)
    pieces = layer_bytes(info, tokens, cache_bits)
    counts = auto_layer_counts(
        [usable_bytes(free) for _, free in gpus],
        pieces.layers,
        pieces.front,
        host_budget(host_available),
        pieces.host_layers,
    )
    every = [(device, free) for device, free in gpus] + [(CPU, 0)]
    kept = [i for i, count in enumerate(counts) if count or i == 0]
    return SplitPlan(
        tuple(every[i][0] for i in kept), tuple(counts[i] for i in kept), tuple(every[i][1] for i in kept)
    )
