"""Look at a model directory without loading it: what it is, how big, and whether it can load.

The model library shows this for every folder it finds, so it has to be cheap and must never
raise: it reads ``config.json`` and the JSON headers of the safetensors files (the first few
kilobytes of each file) and never touches tensor data or imports torch. Anything wrong is
reported as a sentence in ``ModelInfo.problems``; an empty list means "should load".
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engine.cache_footprint import CacheFootprint
from engine.cache_footprint import kv_bytes_per_token as kv_bytes_per_token  # the app's name for it
from engine.config_footprint import config_footprint
from engine.layer_weights import LayerTally, LayerWeights
from engine.loading.int8 import SCALE_SUFFIX, is_int8_config
from engine.loading.read_dequantized import dequantized_on_load
from engine.safe_paths import UnsafePathError, safe_join
from engine.supported import SUPPORTED_ARCHITECTURES

# Bytes per element of each safetensors dtype.
_DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}

# A safetensors header bigger than this is certainly corrupt (real ones are < a few MB), and
# refusing it keeps a garbage length field from making us read gigabytes.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# What the runtime needs beyond weights and KV cache: activations, the torch allocator's slack,
# the tokenizer. A rough constant plus a proportion is honest enough for "will it fit".
_RUNTIME_OVERHEAD_BYTES = 256 * 1024 * 1024
_RUNTIME_OVERHEAD_RATIO = 0.10


# KV-cache widths a user can choose (bits per key or value number); 16 means unquantized.
CACHE_BITS_CHOICES: tuple[int, ...] = (16, 8, 6, 5, 4, 3, 2)


@dataclass
class ModelInfo:
    """What the library knows about one model directory."""

    path: Path
    name: str
    architecture: str | None = None
    model_type: str | None = None
    parameter_count: int | None = None
    # Human-readable: "EXL3 4.0 bpw", "BF16", "F16", "F32", "GGUF (needs import)".
    quantization: str | None = None
    bits_per_weight: float | None = None
    size_bytes: int = 0
    weight_bytes: int = 0
    context_length: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    # What each layer keeps per sequence (keys and values, or a recurrent state), from
    # config.json (``engine.config_footprint``); None: each of ``num_layers`` layers attends.
    footprint: CacheFootprint | None = None
    # The share of the weights in the decoder layers, and in their routed experts (stored bytes and
    # parameters): what a split between the GPU and system memory moves (engine.placement_memory).
    layer_weight_bytes: int = 0
    expert_weight_bytes: int = 0
    expert_parameter_count: int = 0
    # Each decoder layer's weights (engine.layer_weights), in order; empty where the tensor names
    # do not say the layers (a placement then gives each layer an equal share).
    layer_weights: tuple[LayerWeights, ...] = ()
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing found so far would stop the engine from loading the model."""
        return not self.problems

    def kv_cache_bytes(
        self, context_length: int, bytes_per_element: int = 2, cache_bits: tuple[int, int] = (16, 16)
    ) -> int:
        """Bytes of the cache for ``context_length`` tokens (0 if the config lacks shapes): keys
        and values of the attention layers, and for a model with recurrent layers their state per
        sequence and the snapshot pool (``engine.cache_footprint``).

        ``cache_bits`` are the key and value widths (16: unquantized, ``bytes_per_element`` each);
        quantized widths follow the engine's packed layout (:func:`kv_bytes_per_token`)."""
        footprint = self._cache_footprint()
        if footprint is None:
            return 0
        return footprint.cache_bytes(context_length, cache_bits, bytes_per_element)

    def layer_cache_bytes(
        self, context_length: int, bytes_per_element: int = 2, cache_bits: tuple[int, int] = (16, 16)
    ) -> tuple[int, ...] | None:
        """Each decoder layer's part of :meth:`kv_cache_bytes` (they add up to it), in order; None
        where the layer count is unknown or the footprint does not say which layer keeps what."""
        if not self.num_layers:
            return None
        footprint = self._cache_footprint()
        if footprint is None:
            return (0,) * self.num_layers
        parts = footprint.layer_cache_bytes(context_length, cache_bits, bytes_per_element)
        return parts if parts is not None and len(parts) == self.num_layers else None

    def _cache_footprint(self) -> CacheFootprint | None:
        """The footprint config.json gives, else every layer attending with the config's shape
        (None where it lacks them)."""
        if self.footprint is not None:
            return self.footprint
        if not (self.num_layers and self.num_kv_heads and self.head_dim):
            return None
        return CacheFootprint.uniform(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def is_exl3(self) -> bool:
        return (self.quantization or "").startswith("EXL3")

    def memory_needed(
        self, context_length: int | None = None, device: str = "cpu", cache_bits: tuple[int, int] = (16, 16)
    ) -> int:
        """Estimated bytes to run the model with ``context_length`` tokens of context on ``device``
        and a KV cache of ``cache_bits`` (key bits, value bits; 16 = unquantized).

        On the CPU the engine computes dense models in fp32 (its exact reference path), so their
        weights and an unquantized KV cache take 4 bytes per value whatever the file stores; on a
        GPU they stay as stored (bf16/fp16) with an fp16 cache. EXL3 weights stay packed either way.
        """
        ctx = context_length if context_length is not None else min(self.context_length or 4096, 4096)
        cpu = device == "cpu"
        if cpu and not self.is_exl3 and self.parameter_count:
            weights = self.parameter_count * 4
        else:
            weights = self.weight_bytes
        base = weights + self.kv_cache_bytes(ctx, 4 if cpu else 2, cache_bits)
        return int(base * (1 + _RUNTIME_OVERHEAD_RATIO)) + _RUNTIME_OVERHEAD_BYTES


@dataclass(frozen=True)
class MemoryVerdict:
    """The answer to "will it fit": needed vs available, and a one-word summary."""

    needed_bytes: int
    available_bytes: int
    total_bytes: int

    @property
    def verdict(self) -> str:
        """ "fits" (free RAM suffices), "tight" (only if other programs give memory back), "too big"."""
        if self.total_bytes <= 0:
            return "unknown"
        if self.needed_bytes <= self.available_bytes:
            return "fits"
        if self.needed_bytes <= self.total_bytes:
            return "tight"
        return "too big"


def system_memory() -> tuple[int, int]:
    """(available, total) bytes of RAM on this machine; (0, 0) when it cannot be read."""
    try:
        import psutil  # optional; more portable than /proc

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:
        pass
    try:
        values: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    values[key] = int(parts[0]) * 1024  # the file reports kB
        return values.get("MemAvailable", values.get("MemFree", 0)), values.get("MemTotal", 0)
    except (OSError, ValueError):
        return 0, 0


def likely_device(setting: str = "auto") -> str:
    """Where ``setting`` ("auto", "cpu", "cuda") will run a model, guessed without importing
    torch: "auto" means CUDA when an NVIDIA driver is present."""
    if setting in ("cpu", "cuda"):
        return setting
    return "cuda" if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia") else "cpu"


def memory_verdict(
    info: ModelInfo,
    context_length: int | None = None,
    device: str = "cpu",
    cache_bits: tuple[int, int] = (16, 16),
) -> MemoryVerdict:
    """Compare the model's estimated needs at ``context_length`` with this machine's RAM."""
    available, total = system_memory()
    return MemoryVerdict(info.memory_needed(context_length, device, cache_bits), available, total)


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file (raises ValueError with a reason if corrupt)."""
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES or 8 + length > file_size:
            raise ValueError(f"header length {length} does not fit in a {file_size}-byte file")
        blob = fh.read(length)
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_size = file_size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or "data_offsets" not in entry or "shape" not in entry:
            raise ValueError(f"tensor entry {name!r} is malformed")
        start, end = entry["data_offsets"]
        if not (0 <= start <= end <= data_size):
            raise ValueError(f"tensor {name!r} points past the end of the file (truncated download?)")
    return header


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                pass
    return total


def _text_config(config: dict) -> dict:
    """Multimodal configs (Gemma 3) keep the language model's shapes in ``text_config``."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _apply_config(info: ModelInfo, config: dict) -> None:
    archs = config.get("architectures") or []
    info.architecture = archs[0] if archs else None
    info.model_type = config.get("model_type")
    text = _text_config(config)
    info.context_length = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    info.num_layers = text.get("num_hidden_layers")
    heads = text.get("num_attention_heads")
    info.num_kv_heads = text.get("num_key_value_heads") or heads
    hidden = text.get("hidden_size")
    info.head_dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    info.footprint = config_footprint(config)
    if info.num_layers is None and info.footprint is not None and info.footprint.layout:
        # a config that only lists its layers (Nemotron-H's layers_block_type in transformers 5)
        info.num_layers = len(info.footprint.layout)
    if info.architecture is None:
        info.problems.append("config.json does not name an architecture ('architectures' is missing)")
    elif info.architecture not in SUPPORTED_ARCHITECTURES:
        info.problems.append(
            f"architecture {info.architecture} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    qcfg = config.get("quantization_config")
    if isinstance(qcfg, dict):
        method = str(qcfg.get("quant_method", "unknown"))
        if method == "exl3":
            bits = qcfg.get("bits")
            info.bits_per_weight = float(bits) if bits is not None else None
            info.quantization = f"EXL3 {_bits_text(info.bits_per_weight)} bpw" if bits is not None else "EXL3"
        elif is_int8_config(qcfg):  # engine.loading.int8: int8 matrices with row scales
            info.quantization = "INT8"
            info.bits_per_weight = 8.0
        else:
            info.quantization = method.upper()
            if not dequantized_on_load(qcfg):
                info.problems.append(f"quantization method {method!r} is not supported (only EXL3 is)")


def _bits_text(bits: float) -> str:
    """4.0 -> '4.0', 2.5 -> '2.5', 3.25 -> '3.25': what bpw figures look like in model names."""
    text = f"{bits:.2f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _shard_files(path: Path, info: ModelInfo) -> list[Path]:
    """The safetensors files the model consists of, reporting shards the index names but lacks."""
    index_files = sorted(path.glob("*.safetensors.index.json"))
    if index_files:
        try:
            index = json.loads(index_files[0].read_text(encoding="utf-8"))
            names = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            info.problems.append(f"{index_files[0].name} is unreadable ({exc})")
            return sorted(path.glob("*.safetensors"))
        shards: list[Path] = []
        for name in names:
            try:
                # Never stat or read a file the index points to outside the model folder; links
                # the user placed (a Hugging Face cache snapshot) are theirs to follow.
                shard = safe_join(path, name, resolve=False)
            except UnsafePathError as exc:
                info.problems.append(f"{index_files[0].name} names a shard outside the model folder: {exc}")
                continue
            if shard.is_file():
                shards.append(shard)
            else:
                info.problems.append(f"missing shard {name} (named in {index_files[0].name})")
        return shards
    return sorted(path.glob("*.safetensors"))


def _is_exl3_trellis(name: str, entry: dict) -> bool:
    return name.endswith(".trellis") and len(entry["shape"]) == 3


def _is_routed_expert(name: str) -> bool:
    """A tensor of a routed expert (``mlp.experts.3.up_proj``, the fused ``mlp.experts.gate_up_proj``),
    not of a shared one (``mlp.shared_expert``, ``shared_experts``)."""
    return ".experts." in name


def _parameters(name: str, entry: dict) -> int:
    """The numbers tensor ``name`` holds of the model: an EXL3 trellis those of the matrix it
    encodes, its side tensors and an int8 matrix's row scales none."""
    shape = entry["shape"]
    if _is_exl3_trellis(name, entry):
        # A trellis of shape (in/16, out/16, 16K) encodes an in x out weight matrix.
        return shape[0] * 16 * shape[1] * 16
    if name.endswith((".suh", ".svh", ".su", ".sv", ".mcg", ".mul1")):
        return 0  # EXL3 side tensors: scales and codebook flags, not parameters
    if name.endswith("weight" + SCALE_SUFFIX) and entry.get("dtype") != "I8":
        return 0  # an int8 matrix's row scales (engine.loading.int8), not parameters
    count = 1
    for dim in shape:
        count *= dim
    return count


def _apply_headers(info: ModelInfo, files: list[Path]) -> None:
    params = 0
    weight_bytes = 0
    dtype_bytes: dict[str, int] = {}
    tally = LayerTally(info.num_layers)
    for file in files:
        try:
            header = read_safetensors_header(file)
        except (OSError, ValueError) as exc:
            info.problems.append(f"{file.name} is corrupt: {exc}")
            continue
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            weight_bytes += end - start
            expert = _is_routed_expert(name)
            if ".layers." in name:
                info.layer_weight_bytes += end - start
            if expert:
                info.expert_weight_bytes += end - start
            count = _parameters(name, entry)
            tally.add(name, end - start, count, expert)
            params += count
            if expert:
                info.expert_parameter_count += count
            if count and not _is_exl3_trellis(name, entry):
                dtype = entry.get("dtype", "?")
                dtype_bytes[dtype] = dtype_bytes.get(dtype, 0) + (end - start)
    info.parameter_count = params or None
    info.layer_weights = tally.layers()
    if info.layer_weights:  # the decoder's layers by name, not a vision tower's or MTP layers
        info.layer_weight_bytes = sum(layer.stored_bytes for layer in info.layer_weights)
    info.weight_bytes = weight_bytes
    if info.quantization is None and dtype_bytes:
        info.quantization = max(dtype_bytes, key=dtype_bytes.__getitem__)
    if info.bits_per_weight is None and dtype_bytes and info.quantization in _DTYPE_BYTES:
        info.bits_per_weight = float(_DTYPE_BYTES[info.quantization] * 8)


def inspect_model(path: str | os.PathLike[str]) -> ModelInfo:
    """Describe the model in directory ``path``; never raises for a bad model, lists problems."""
    path = Path(path)
    info = ModelInfo(path=path, name=path.name)
    if not path.is_dir():
        info.problems.append(f"{path} is not a folder")
        return info
    info.size_bytes = _dir_size(path)
    config_path = path / "config.json"
    ggufs = sorted(path.glob("*.gguf"))
    if not config_path.is_file():
        if ggufs:
            info.quantization = "GGUF"
            info.problems.append(
                f"{ggufs[0].name} is a GGUF file: import it first (python -m engine import-gguf)"
            )
        else:
            info.problems.append("config.json is missing: this is not a Hugging Face model folder")
        return info
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        info.problems.append(f"config.json is unreadable ({exc})")
        return info
    _apply_config(info, config)
    files = _shard_files(path, info)
    if not files and not any("missing shard" in p for p in info.problems):
        info.problems.append("no .safetensors weight files")
    _apply_headers(info, files)
    if not (path / "tokenizer.json").is_file():
        info.problems.append("tokenizer.json is missing")
    return info


def looks_like_model_dir(path: Path) -> bool:
    """Cheap test used when scanning folders: does ``path`` hold a model (or a broken one)?"""
    return (path / "config.json").is_file() or any(path.glob("*.safetensors")) or any(path.glob("*.gguf"))
