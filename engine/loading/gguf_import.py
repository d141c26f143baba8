"""Import a GGUF file as a Hugging Face model directory the engine can load.

The engine runs HF-format models (safetensors + config.json + tokenizer.json). A GGUF file holds
the same model in llama.cpp's layout, quantized with ggml's block formats. Importing means:

1. parse the header (``gguf_reader``) and map the architecture (``gguf_arch``);
2. rebuild the tokenizer and chat template (``gguf_tokenizer``);
3. dequantize every tensor with the ``gguf`` package, undo llama.cpp's layout changes, and stream
   it into safetensors;
4. write config.json / generation_config.json / tokenizer files.

Weights are written as float32 by default. The dequantized values (``d * q + m`` with fp16
scales) are not representable in bf16 or fp16, so anything narrower would change the model a
second time after quantization; the parity tests compare with transformers' float32
dequantization. ``dtype="bfloat16"`` halves the size; ``dtype="int8"`` stores every matrix as int8
codes with a scale per row (``engine.loading.int8``: a quarter of float32, about 1.4x a 4-bit GGUF,
and a quarter of the memory on the CPU, which multiplies the codes as they are) and the rest
(norms) as float32.

Everything is written into a hidden sibling staging directory (``engine.staging``) and renamed
into place at the end, so a failed or interrupted import leaves nothing half-written; one left by a
killed process is removed by the next import of the same target (or the app's startup cleanup).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import GGUFImportError, GGUFNotFoundError
from engine.loading import int8
from engine.loading.gguf_arch import (
    ArchContext,
    ArchSpec,
    arch_spec,
    expert_tensor,
    fix_tensor,
    hf_tensor_name,
    needs_whole_tensor,
)
from engine.loading.gguf_reader import GGUFFile, TensorInfo, ggml_type_name, read_gguf
from engine.loading.gguf_tokenizer import build_tokenizer
from engine.staging import make_staging_dir, remove_stale_staging
from engine.units import format_bytes

__all__ = ["import_gguf", "SUPPORTED_DTYPES"]

Progress = Callable[[float, str], None]

FLOAT_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}
INT8 = "int8"  # matrices as int8 with row scales, everything else float32
SUPPORTED_DTYPES = (*FLOAT_DTYPES, INT8)
SHARD_BYTES = 4 * 1024**3  # HF-style shards above this size
CHUNK_ELEMENTS = 1 << 22  # rows are dequantized ~16 MiB (float32) at a time
DISK_MARGIN = 64 * 1024**2  # tokenizer files and slack on top of the weights


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    progress: Progress | None = None,
    *,
    dtype: str = "float32",
) -> Path:
    """Convert ``gguf_path`` into a new HF model directory ``out_dir`` and return its path.

    ``out_dir`` must not exist yet (or be empty). ``progress(fraction, message)`` is called as
    the import advances. Raises :class:`GGUFImportError` for a missing, truncated or corrupt file,
    an unsupported architecture, tensor type or tokenizer, or too little disk space.
    """
    report = progress or (lambda fraction, message: None)
    if dtype not in SUPPORTED_DTYPES:
        raise GGUFImportError(
            f"unsupported output dtype {dtype!r} (use one of {', '.join(SUPPORTED_DTYPES)})"
        )
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise GGUFNotFoundError(f"{gguf_path}: no such file")
    _check_destination(out_dir)

    report(0.0, f"reading {gguf_path.name}")
    gguf = read_gguf(gguf_path)
    try:
        plan = _plan(gguf, dtype)
        _check_disk_space(out_dir.parent, plan.output_bytes + DISK_MARGIN)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out_dir.parent, out_dir.name)
        staging = make_staging_dir(out_dir)
        try:
            _write_model(gguf, plan, staging, report)
            _publish(staging, out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        gguf.close()
    report(1.0, f"imported {out_dir.name}")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Planning: everything that can fail cheaply is checked before a byte is written
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Output:
    """One tensor of the output: all of a GGUF tensor, or one expert of a stacked 3-D one."""

    info: TensorInfo
    name: str
    shape: tuple[int, ...]
    expert: int | None = None  # index along the stacked tensor's first axis


class _Plan:
    def __init__(self, spec: ArchSpec, config: dict[str, Any], tensors: list[_Output], dtype: str):
        self.spec, self.config, self.tensors, self.dtype = spec, config, tensors, dtype
        # What tensors that are not int8 matrices are written as.
        self.float_dtype = "float32" if dtype == INT8 else dtype
        self.output_bytes = sum(self.bytes_of(t) for t in tensors)

    def quantized(self, item: _Output) -> bool:
        """Whether ``item`` is written as int8 codes + row scales: a matrix, with int8 output."""
        shape = item.shape
        return self.dtype == INT8 and len(shape) == 2 and min(shape) > 1 and item.name.endswith(".weight")

    def entries(self, item: _Output) -> list[tuple[str, str, list[int], int]]:
        """``(name, safetensors dtype tag, shape, bytes)`` of what ``item`` is written as, in order."""
        if self.quantized(item):
            rows = item.shape[0]
            return [
                (item.name, "I8", list(item.shape), _size(item.shape)),
                (item.name + int8.SCALE_SUFFIX, "F32", [rows], 4 * rows),
            ]
        tag, itemsize = FLOAT_DTYPES[self.float_dtype]
        return [(item.name, tag, list(item.shape), _size(item.shape) * itemsize)]

    def bytes_of(self, item: _Output) -> int:
        return sum(entry[3] for entry in self.entries(item))


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _plan(gguf: GGUFFile, dtype: str) -> _Plan:
    path = str(gguf.path)
    spec = arch_spec(gguf.metadata, path)
    _check_dequantizable(gguf, path)
    names = {t.name for t in gguf.tensors}
    embed = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.shape) != 2:
        raise GGUFImportError(f"{path}: the file has no 2-D token_embd.weight tensor")
    ctx = ArchContext(path=path, tensor_names=frozenset(names), vocab_rows=int(embed.shape[0]))
    config = spec.build_config(gguf.metadata, ctx)
    _check_block_count(gguf, config, path)

    tensors: list[_Output] = []
    for info in gguf.tensors:
        expert = expert_tensor(spec, info.name)
        if expert is None:
            shape, parts = info.shape, info.name.split(".")
            if len(shape) == 1 and len(parts) == 4 and parts[2] in spec.row_vectors:
                shape = (1, shape[0])
            tensors.append(_Output(info, hf_tensor_name(spec, info.name, path), shape))
        elif expert[1] is not None:  # an old file's per-expert 2-D tensor
            tensors.append(_Output(info, expert[0].format(e=expert[1]), info.shape))
        else:
            tensors += [_Output(info, expert[0].format(e=e), info.shape[1:], e) for e in range(info.shape[0])]
    if spec.expert_tensors:
        _check_experts(gguf, spec, config, path)
    return _Plan(spec, config, tensors, dtype)


def _check_experts(gguf: GGUFFile, spec: ArchSpec, config: dict[str, Any], path: str) -> None:
    """Every sparse layer (one with a router) has all its experts, as many as the metadata says."""
    count = int(config.get("num_experts") or config["num_local_experts"])
    arch = spec.gguf_name
    shapes = {t.name: t.shape for t in gguf.tensors}
    found: dict[tuple[int, str], set[int]] = {}  # (layer, stacked stem) -> expert indices
    for name, shape in shapes.items():
        expert = expert_tensor(spec, name)
        if expert is None:
            continue
        layer, stem = int(name.split(".")[1]), name.split(".")[2]
        if expert[1] is None:
            if len(shape) != 3 or shape[0] != count:
                raise GGUFImportError(
                    f"{path}: metadata says {count} experts ({arch}.expert_count), "
                    f"but {name} has shape {list(shape)}"
                )
            found.setdefault((layer, stem), set()).update(range(count))
        else:
            found.setdefault((layer, f"{stem}_exps"), set()).add(expert[1])
    routers = {int(n.split(".")[1]): shapes[n] for n in shapes if n.endswith(".ffn_gate_inp.weight")}
    for layer in sorted({layer for layer, _ in found} | set(routers)):
        router = routers.get(layer)
        if router is None:
            raise GGUFImportError(f"{path}: layer {layer} has expert tensors but no router (ffn_gate_inp)")
        if router[0] != count:
            raise GGUFImportError(
                f"{path}: metadata says {count} experts ({arch}.expert_count), "
                f"but the router blk.{layer}.ffn_gate_inp.weight has {router[0]} rows"
            )
        for stem in spec.expert_tensors:
            indices = found.get((layer, stem), set())
            if indices != set(range(count)):
                missing = sorted(set(range(count)) - indices) or sorted(indices - set(range(count)))
                raise GGUFImportError(
                    f"{path}: layer {layer}: {stem} expert tensors are missing or extra "
                    f"for experts {missing} (metadata says {count} experts)"
                )


def _check_block_count(gguf: GGUFFile, config: dict[str, Any], path: str) -> None:
    layers = {int(t.name.split(".")[1]) for t in gguf.tensors if t.name.startswith("blk.")}
    expected = set(range(int(config["num_hidden_layers"])))
    if layers != expected:
        raise GGUFImportError(
            f"{path}: file is corrupt: metadata says {len(expected)} layers, "
            f"but tensors exist for {len(layers)}"
        )


def _check_dequantizable(gguf: GGUFFile, path: str) -> None:
    """Try one block of every tensor type in the file before writing anything."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    for ggml_type in sorted({t.ggml_type for t in gguf.tensors}):
        qtype = GGMLQuantizationType(ggml_type)
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError) as exc:
            raise GGUFImportError(
                f"{path}: tensor type {ggml_type_name(ggml_type)} cannot be dequantized by the installed "
                f"gguf package ({exc})"
            ) from exc


def _check_destination(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise GGUFImportError(f"{out_dir}: already exists and is not empty; choose a new directory")


def _check_disk_space(parent: Path, needed: int) -> None:
    probe = parent
    while not probe.exists():  # the parent may not exist yet: measure the nearest existing one
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise GGUFImportError(
            f"{parent}: not enough disk space: the import needs about {format_bytes(needed, 2)}, "
            f"{format_bytes(free, 2)} are free"
        )


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _write_model(gguf: GGUFFile, plan: _Plan, out: Path, report: Progress) -> None:
    report(0.01, "building the tokenizer")
    context = plan.config.get("max_position_embeddings")
    tok = build_tokenizer(gguf.metadata, str(gguf.path), context_length=context)
    _write_json(out / "tokenizer_config.json", tok.config)
    tok.backend.save(str(out / "tokenizer.json"))

    config = {
        "architectures": [plan.spec.hf_architecture],
        "model_type": plan.spec.model_type,
        **plan.config,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "torch_dtype": plan.float_dtype,
        "dtype": plan.float_dtype,
    }
    if plan.dtype == INT8:
        config["quantization_config"] = int8.quantization_config()
    _write_json(out / "config.json", config)
    generation = {"bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    stops = tok.stop_token_ids
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    _write_json(out / "generation_config.json", generation)

    report(0.1, "converting weights")
    _write_safetensors(gguf, plan, out, lambda f, m: report(0.1 + 0.89 * f, m))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _publish(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():
        out_dir.rmdir()  # checked empty before we started
    os.replace(staging, out_dir)


def _shards(plan: _Plan) -> list[list[_Output]]:
    ordered = sorted(plan.tensors, key=lambda item: item.name)
    shards: list[list[_Output]] = [[]]
    size = 0
    for item in ordered:
        n = plan.bytes_of(item)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def _write_safetensors(gguf: GGUFFile, plan: _Plan, out: Path, report: Progress) -> None:
    shards = _shards(plan)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = max(plan.output_bytes, 1)
    done = 0
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        with open(out / file_name, "wb") as handle:
            _write_header(handle, shard, plan)
            for item in shard:
                done += _write_tensor(handle, gguf, plan, item)
                weight_map |= {entry[0]: file_name for entry in plan.entries(item)}
                report(done / total, f"converting weights ({item.name})")
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": plan.output_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(out / "model.safetensors.index.json", index)


def _write_header(handle: Any, shard: list[_Output], plan: _Plan) -> None:
    """safetensors layout: u64 header length, JSON header (dtype, shape, byte range relative to
    the data), then the raw little-endian tensors back to back in header order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in shard:
        for name, tag, shape, n in plan.entries(item):
            header[name] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # keeps the data 8-byte aligned, as safetensors writes it
    handle.write(len(blob).to_bytes(8, "little"))
    handle.write(blob)


def _write_tensor(handle: Any, gguf: GGUFFile, plan: _Plan, item: _Output) -> int:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    info = item.info
    qtype = GGMLQuantizationType(info.ggml_type)
    raw = gguf.tensor_bytes(info)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    raw = raw.reshape(rows, -1)
    if item.expert is not None:  # one expert of a stacked tensor: its own block of whole rows
        rows //= info.shape[0]
        raw = raw[item.expert * rows : (item.expert + 1) * rows]
    written = 0
    if needs_whole_tensor(plan.spec, info.name) or rows == 1:
        step = rows
    else:
        step = max(1, CHUNK_ELEMENTS // max(1, info.shape[-1]))
    quantized = plan.quantized(item)
    scales: list[np.ndarray] = []  # an int8 matrix's row scales, written after its codes
    for start in range(0, rows, step):
        block = dequantize(raw[start : start + step], qtype).astype(np.float32, copy=False)
        if step == rows:
            block = block.reshape(item.shape)
        block = fix_tensor(plan.spec, info.name, block, plan.config)
        if quantized:
            data, scale = int8.quantize_rows(block.reshape(-1, item.shape[-1]))
            scales.append(scale)
        else:
            data = _cast(np.ascontiguousarray(block), plan.float_dtype)
        handle.write(data.tobytes())
        written += data.nbytes
    if quantized:
        data = np.concatenate(scales).astype("<f4")
        handle.write(data.tobytes())
        written += data.nbytes
    expected = plan.bytes_of(item)
    if written != expected:
        raise GGUFImportError(
            f"{gguf.path}: tensor {item.name!r} dequantized to {written} bytes, expected {expected}"
        )
    return written


def _cast(block: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return block.astype("<f4", copy=False)
    if dtype == "float16":
        return block.astype("<f2")
    # bfloat16: the top 16 bits of float32, rounded to nearest even; NaN stays a (quiet) NaN.
    bits = block.astype("<f4", copy=False).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )
    nan = np.isnan(block)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded.astype("<u2", copy=False)
