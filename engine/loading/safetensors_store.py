"""Lazy, memory-mapped access to a model directory's safetensors files.

A model is stored as one ``model.safetensors`` or as shards listed by
``model.safetensors.index.json``. :class:`WeightStore` opens every shard once (the header is
parsed, the data stays memory-mapped) and reads a tensor only when it is asked for, so loading
never needs twice the model's size in RAM.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import read_json
from engine.errors import ModelLoadError
from engine.loading import mxfp4
from engine.safe_paths import UnsafePathError, safe_join

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB


def _check_header(path: Path) -> None:
    """Validate a safetensors header ourselves so a corrupt file gets an error naming it.

    The safetensors library's own message ("HeaderTooLarge", "InvalidHeaderDeserialization")
    does not say which of possibly dozens of shards is broken.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise ModelLoadError(f"{path} has a corrupt safetensors header (declares {n} header bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelLoadError(f"{path} has a corrupt safetensors header (not valid JSON)") from None
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info.get("data_offsets", (0, 0))
        if end > data_size:
            raise ModelLoadError(
                f"{path} is truncated: tensor '{name}' ends at byte {end} of {data_size} data bytes"
            )


class TensorIndex:
    """Name lookups over a store's index of tensor names (``_index()``): what the model builder
    asks of any store (the safetensors files, or random weights of a shape)."""

    def _index(self) -> Mapping[str, object]:
        raise NotImplementedError

    def keys(self) -> set[str]:
        return set(self._index())

    def has(self, key: str) -> bool:
        return key in self._index()

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self._index())


# safetensors' dtype names, for placeholders of stored tensors (WeightStore.meta)
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_DTYPES |= {"I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_DTYPES |= {"BOOL": torch.bool}


class WeightStore(TensorIndex):
    """All tensors of a model directory, by name, read lazily from memory-mapped shards (or of
    the safetensors ``files`` given, e.g. a conversion's finished blocks).

    An MXFP4 tensor (gpt-oss's experts: ``name_blocks`` + ``name_scales``) is listed and read as
    the one dequantized tensor ``name`` (``engine.loading.mxfp4``); its two parts are not listed."""

    def __init__(self, directory: str | Path, files: Iterable[Path] | None = None) -> None:
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for path in self._shard_paths() if files is None else files:
            _check_header(path)
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # the library raises its own exception types
                raise ModelLoadError(f"cannot read {path}: {exc}") from None
            self._handles[path] = handle
            for key in handle.keys():
                self._file_of[key] = path
        self._mxfp4 = mxfp4.packed_pairs(self._file_of)
        hidden = {part for pair in self._mxfp4.values() for part in pair}
        self._listed = {k: p for k, p in self._file_of.items() if k not in hidden}
        self._listed |= {name: self._file_of[blocks] for name, (blocks, _) in self._mxfp4.items()}

    def _shard_paths(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} has no 'weight_map'")
            shards = sorted(set(map(str, weight_map.values())))
            try:
                # The index comes with the model (a download, a copy): its names must not reach
                # files outside the model folder. Symlinks placed by the user (HF cache) may.
                paths = [safe_join(self.directory, s, resolve=False) for s in shards]
            except UnsafePathError as exc:
                raise ModelLoadError(f"{index} names a shard outside the model folder: {exc}") from None
            missing = [s for s, p in zip(shards, paths, strict=True) if not p.exists()]
            if missing:
                raise ModelLoadError(
                    f"model in {self.directory} is incomplete: shard(s) {', '.join(missing)} "
                    f"listed in {index.name} are missing"
                )
            return paths
        single = self.directory / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.directory.glob("*.safetensors"))
        if not found:
            raise ModelLoadError(f"no safetensors weights found in {self.directory}")
        return found

    def _index(self) -> dict[str, Path]:
        return self._listed

    def shape(self, key: str) -> list[int]:
        if key in self._mxfp4:
            return mxfp4.dequantized_shape(self.shape(self._mxfp4[key][0]))
        return list(self._handle(key).get_slice(key).get_shape())

    def meta(self, key: str) -> torch.Tensor:
        """A ``meta`` tensor of the stored shape and dtype (nothing is read)."""
        if key in self._mxfp4:
            return torch.empty(self.shape(key), dtype=mxfp4.DTYPE, device="meta")
        info = self._handle(key).get_slice(key)
        return torch.empty(info.get_shape(), dtype=_DTYPES[info.get_dtype()], device="meta")

    def _handle(self, key: str):
        try:
            return self._handles[self._file_of[key]]
        except KeyError:
            raise ModelLoadError(f"tensor '{key}' is missing from the weights in {self.directory}") from None

    def get(
        self,
        key: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shape: Iterable[int] | None = None,
    ) -> torch.Tensor:
        """Read one tensor, optionally converting it and checking its shape."""
        if key in self._mxfp4:
            blocks, scales = (self._handle(k).get_tensor(k) for k in self._mxfp4[key])
            tensor = mxfp4.dequantize(blocks, scales, dtype if dtype is not None else mxfp4.DTYPE)
        else:
            tensor = self._handle(key).get_tensor(key)
        if shape is not None and list(tensor.shape) != list(shape):
            raise ModelLoadError(
                f"tensor '{key}' in {self.directory} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        return tensor

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._handles)
