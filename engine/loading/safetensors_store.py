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
from engine.loading import int8, mxfp4
from engine.safe_paths import UnsafePathError, safe_join

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB


def _check_header(path: Path) -> dict[str, int]:
    """Validate a safetensors header ourselves so a corrupt file gets an error naming it; return
    where each tensor's bytes start in the file.

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
    starts = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info.get("data_offsets", (0, 0))
        if end > data_size:
            raise ModelLoadError(
                f"{path} is truncated: tensor '{name}' ends at byte {end} of {data_size} data bytes"
            )
        starts[name] = 8 + n + start
    return starts


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

    def is_int8(self, key: str) -> bool:
        """Whether ``key`` is an int8 matrix with row scales (``engine.loading.int8``), which
        :meth:`WeightStore.int8_matrix` reads as stored; a store of other weights has none."""
        return False


# safetensors' dtype names, for placeholders of stored tensors (WeightStore.meta)
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_DTYPES |= {"I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_DTYPES |= {"BOOL": torch.bool}


class WeightStore(TensorIndex):
    """All tensors of a model directory, by name, read lazily from memory-mapped shards (or of
    the safetensors ``files`` given, e.g. a conversion's finished blocks).

    An MXFP4 tensor (gpt-oss's experts: ``name_blocks`` + ``name_scales``) is listed and read as
    the one dequantized tensor ``name`` (``engine.loading.mxfp4``); its two parts are not listed.
    An int8 matrix with row scales (``name`` + ``name_scale``, ``engine.loading.int8``) is listed
    as ``name`` and read dequantized; :meth:`int8_matrix` gives its codes and scales as stored."""

    def __init__(self, directory: str | Path, files: Iterable[Path] | None = None) -> None:
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._starts: dict[str, int] = {}  # where each tensor's bytes start in its file
        for path in self._shard_paths() if files is None else files:
            self._starts |= _check_header(path)
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # the library raises its own exception types
                raise ModelLoadError(f"cannot read {path}: {exc}") from None
            self._handles[path] = handle
            for key in handle.keys():
                self._file_of[key] = path
        self._mxfp4 = mxfp4.packed_pairs(self._file_of)
        self._int8 = int8.scale_pairs(self._file_of, self._stored_dtype)
        hidden = {part for pair in self._mxfp4.values() for part in pair} | set(self._int8.values())
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
        if key in self._int8:  # read as its dequantized float32 matrix
            return torch.empty(self.shape(key), dtype=torch.float32, device="meta")
        info = self._handle(key).get_slice(key)
        return torch.empty(info.get_shape(), dtype=_DTYPES[info.get_dtype()], device="meta")

    def _stored_dtype(self, key: str) -> str:
        return self._handle(key).get_slice(key).get_dtype()

    def is_int8(self, key: str) -> bool:
        return key in self._int8

    def int8_matrix(self, key: str, shape: Iterable[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 codes ``[rows, cols]`` and float32 row scales ``[rows]`` stored for ``key``
        (see :meth:`is_int8`), checked against each other and ``shape``."""
        if key not in self._int8:
            raise ModelLoadError(f"tensor '{key}' in {self.directory} is not stored as int8 with row scales")
        codes = self._read_copy(key)
        scale = self._handle(self._int8[key]).get_tensor(self._int8[key])
        int8.check_pair(key, codes, scale, str(self.directory))
        if shape is not None and list(codes.shape) != list(shape):
            raise ModelLoadError(
                f"tensor '{key}' in {self.directory} has shape {list(codes.shape)}, expected {list(shape)}"
            )
        return codes, scale.to(torch.float32)

    def _read_copy(self, key: str) -> torch.Tensor:
        """``key`` read from its file into memory of its own, not mapped from the file.

        The int8 codes stay in use for the model's life: read through the memory map, each
        touched page of the file would stay resident beside the copy the kernel needs anyway (it
        wants aligned memory, and a tensor in a safetensors file starts at any byte), doubling the
        model in memory. A fresh tensor is aligned, and the codes' pages are never mapped."""
        path = self._file_of[key]
        info = self._handle(key).get_slice(key)
        tensor = torch.empty(info.get_shape(), dtype=_DTYPES[info.get_dtype()])
        with open(path, "rb") as f:
            f.seek(self._starts[key])
            if f.readinto(tensor.view(-1).view(torch.uint8).numpy()) != tensor.nbytes:
                raise ModelLoadError(f"{path} is truncated: tensor '{key}' could not be read whole")
        return tensor

    def get_part(
        self,
        key: str,
        dim: int,
        start: int,
        end: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``start .. end - 1`` of ``key``, read alone
        from the memory-mapped file: the rest of the tensor is never read (a tensor-parallel rank
        loading its shard). A tensor stored packed (MXFP4, int8 with scales) is read whole and
        cut."""
        if key in self._mxfp4 or key in self._int8:
            tensor = self.get(key, dtype=dtype).narrow(dim, start, end - start)
        else:
            tensor = _read_part(self._handle(key).get_slice(key), dim, start, end)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
        return tensor if device is None else tensor.to(device)

    def int8_part(self, key: str, dim: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 codes of rows (``dim`` 0) or columns (``dim`` 1) ``start .. end - 1`` of
        ``key`` (see :meth:`int8_matrix`) and the scales of those rows (of every row for
        columns), read alone from the file."""
        if key not in self._int8:
            raise ModelLoadError(f"tensor '{key}' in {self.directory} is not stored as int8 with row scales")
        codes = _read_part(self._handle(key).get_slice(key), dim, start, end)
        scale_key = self._int8[key]
        scales = self._handle(scale_key).get_slice(scale_key)
        scale = _read_part(scales, 0, start, end) if dim == 0 else scales[:]
        return codes.contiguous(), scale.to(torch.float32)

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
        elif key in self._int8:
            tensor = int8.dequantize(*self.int8_matrix(key), dtype if dtype is not None else torch.float32)
        else:
            tensor = self._handle(key).get_tensor(key)
            wants_float = dtype is not None and dtype.is_floating_point
            if tensor.dtype == torch.int8 and key.endswith("weight") and wants_float:
                # Codes without their scales would load as weights 127x too large, silently.
                raise ModelLoadError(
                    f"tensor '{key}' in {self.directory} is int8 but its scale tensor "
                    f"'{key}{int8.SCALE_SUFFIX}' is missing"
                )
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


def _read_part(stored, dim: int, start: int, end: int) -> torch.Tensor:
    """``start:end`` along ``dim`` (0 or 1) of a safetensors slice handle, read from the file."""
    if dim == 0:
        return stored[start:end]
    if dim == 1:
        return stored[:, start:end]
    raise ValueError(f"a part is taken along dimension 0 or 1, not {dim}")
