"""How a model's memory divides between the GPU and system memory, for each way it can run: all on
the GPU, its routed experts in system memory (``--experts-on cpu``), or its first N layers on the
GPU and the rest on the CPU (``--gpu-layers N``); which of them to suggest for a GPU of a given
size; and the pieces a layer split places (``--split-layers auto``). From what ``engine.inspect``
read of the files: no torch, cheap enough for a label.

Parts that move to system memory take the form the engine gives them there: routed experts and
layers of an EXL3 model are dequantized to 16 bits, anything else stays as stored. The estimate's
overhead (activations, allocator slack) follows the part left on the GPU.

A layer split counts each layer as it is: its weights as stored (``ModelInfo.layer_weights``:
dense first layers before mixtures of experts, EXL3 layers of their own bit rates) and its part
of the cache (``ModelInfo.layer_cache_bytes``: keys and values growing with the context, a
recurrent layer's fixed state, nothing for a layer that reads another's keys). Where those are
unknown (tensor names of an unknown layout, a config without shapes), each layer gets an equal
share of the layers' weights or of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.inspect import ModelInfo

PLACEMENTS = ("gpu", "experts", "layers")
_OVERHEAD_RATIO = 0.10  # as engine.inspect's estimate


@dataclass(frozen=True)
class MemorySplit:
    """Bytes on the GPU and in system memory."""

    gpu_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class Suggestion:
    """Where to run a model: ``placement`` one of :data:`PLACEMENTS`, ``gpu_layers`` the layers
    on the GPU for "layers"; ``needed`` the all-on-GPU estimate it was chosen against."""

    placement: str
    gpu_layers: int | None
    needed: MemorySplit


def _host_form(info: ModelInfo, stored: int, parameters: int | None = None) -> int:
    """Bytes in system memory of ``stored`` bytes of weights (EXL3: dequantized to 16 bits)."""
    if not info.is_exl3:
        return stored
    if parameters is not None:
        return 2 * parameters
    bits = info.bits_per_weight or 16.0
    return int(stored * 16 / bits)


def memory_split(
    info: ModelInfo,
    context: int,
    cache_bits: tuple[int, int] = (16, 16),
    placement: str = "gpu",
    gpu_layers: int | None = None,
) -> MemorySplit:
    """The GPU and system-memory parts of running ``info``'s model with ``context`` tokens of
    context placed as ``placement`` says (``gpu_layers`` for "layers")."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    total = info.memory_needed(context, "cuda", cache_bits)
    if placement == "gpu":
        return MemorySplit(total, 0)
    if placement == "experts":
        moved = info.expert_weight_bytes
        host = _host_form(info, moved, info.expert_parameter_count)
        return MemorySplit(total - int(moved * (1 + _OVERHEAD_RATIO)), host)
    parts = _layer_parts(info, context, cache_bits)
    layers = len(parts.weights)
    n = layers if gpu_layers is None else max(0, min(int(gpu_layers), layers))
    moved = int(sum(parts.weights[n:]))
    cache = int(sum(parts.cache[n:]))
    host = (sum(parts.host_weights[n:]) if parts.exact_weights else _host_form(info, moved)) + cache
    return MemorySplit(total - int((moved + cache) * (1 + _OVERHEAD_RATIO)), host)


@dataclass(frozen=True)
class _LayerParts:
    """Each decoder layer's weights as stored, in their system-memory form, and its cache;
    ``exact_weights`` False where the weights are equal shares."""

    weights: tuple[float, ...]
    host_weights: tuple[int, ...]
    cache: tuple[float, ...]
    exact_weights: bool


def _layer_parts(info: ModelInfo, context: int, cache_bits: tuple[int, int]) -> _LayerParts:
    """``info``'s layers one by one for ``context`` tokens of cache at ``cache_bits``: as the
    files and config.json say them, else equal shares."""
    layers = info.num_layers or 0
    if not layers:
        return _LayerParts((), (), (), False)
    stored = info.layer_weights
    exact = len(stored) == layers
    if exact:
        weights: tuple[float, ...] = tuple(layer.stored_bytes for layer in stored)
        host = tuple(
            _host_form(info, layer.stored_bytes, layer.parameters if info.is_exl3 else None)
            for layer in stored
        )
    else:
        weights = (info.layer_weight_bytes / layers,) * layers
        host = (_host_form(info, int(weights[0])),) * layers
    cache: tuple[float, ...] | None = info.layer_cache_bytes(context, 2, cache_bits)
    if cache is None:
        cache = (info.kv_cache_bytes(context, 2, cache_bits) / layers,) * layers
    return _LayerParts(weights, host, cache, exact)


@dataclass(frozen=True)
class LayerBytes:
    """A model's GPU estimate by where a layer split puts it: ``front`` (embedding, final norm,
    head and the runtime's fixed overhead) on the first device, ``layers[i]`` (layer i's weights
    and cache) on the GPU that runs it, ``host_layers[i]`` the same layer in system memory.
    ``front`` plus the first N of ``layers`` is the "layers" estimate for N (:func:`memory_split`)."""

    front: int
    layers: tuple[int, ...]
    host_layers: tuple[int, ...]


def layer_bytes(info: ModelInfo, context: int, cache_bits: tuple[int, int] = (16, 16)) -> LayerBytes:
    """``info``'s model cut into a layer split's pieces, for ``context`` tokens of cache at
    ``cache_bits``, each layer with its own weights and cache (equal shares where unknown): a
    layer on a GPU as stored (EXL3 stays packed there), on the CPU in its system-memory form."""
    total = info.memory_needed(context, "cuda", cache_bits)
    parts = _layer_parts(info, context, cache_bits)
    on_gpu = tuple(int((w + c) * (1 + _OVERHEAD_RATIO)) for w, c in zip(parts.weights, parts.cache))
    on_host = tuple(h + int(c) for h, c in zip(parts.host_weights, parts.cache))
    return LayerBytes(total - sum(on_gpu), on_gpu, on_host)


def layers_that_fit(info: ModelInfo, context: int, cache_bits: tuple[int, int], gpu_bytes: int) -> int:
    """The most layers whose "layers" split fits ``gpu_bytes`` on the GPU (0 where none does).
    A split's GPU bytes grow with its layers, so the count is found by bisection."""
    lo, hi = 0, info.num_layers or 0  # lo fits (or is 0); the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if memory_split(info, context, cache_bits, "layers", mid).gpu_bytes <= gpu_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggest_placement(
    info: ModelInfo, context: int, cache_bits: tuple[int, int], gpu_bytes: int
) -> Suggestion:
    """All on the GPU where the model fits ``gpu_bytes`` (or the GPU's size is unknown, 0); else
    its routed experts in system memory where the rest then fits; else as many layers on the GPU
    as fit."""
    needed = memory_split(info, context, cache_bits)
    if gpu_bytes <= 0 or needed.gpu_bytes <= gpu_bytes:
        return Suggestion("gpu", None, needed)
    if info.expert_weight_bytes and memory_split(info, context, cache_bits, "experts").gpu_bytes <= gpu_bytes:
        return Suggestion("experts", None, needed)
    return Suggestion("layers", layers_that_fit(info, context, cache_bits, gpu_bytes), needed)
