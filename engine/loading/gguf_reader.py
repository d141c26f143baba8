"""A small, strict reader for GGUF headers: metadata, tensor table, and raw tensor bytes.

Why not ``gguf.GGUFReader``: it builds a numpy object per array item, so opening a model with
a 262k-token vocabulary (Gemma 3) takes tens of seconds before a single weight is read; here the
same header parses in about a second. It also lets every malformed or truncated file fail with
one precise :class:`GGUFImportError` instead of an ``IndexError`` from deep inside numpy.
Dequantization itself stays with the ``gguf`` package (see ``gguf_import``).

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata
count; the metadata key/values; the tensor infos (name, dims, type, offset); padding to
``general.alignment``; then the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import GGUFImportError, GGUFNotFoundError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types, by their on-disk code: (struct format, numpy dtype) for scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING = 8
_ARRAY = 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): GGUF's dims reversed
    ggml_type: int
    offset: int  # absolute position of the first byte in the file
    n_bytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    file_size: int
    _map: mmap.mmap | None = field(default=None, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view of the mapped file (no copy)."""
        if self._map is None:
            self._map = _map_file(self.path)
        return np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # numpy views still point into the map; it is closed when they are collected.
                pass
            self._map = None


def _map_file(path: Path) -> mmap.mmap:
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


class _Cursor:
    """Sequential little-endian reads with bounds checks that name what was being read."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFImportError(
                f"{self.path}: file is truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, "
                f"but the file has {self.size} bytes"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        self.need(length, what)
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            # llama.cpp writes some vocabularies with invalid UTF-8 in single tokens; keep them.
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            value = self.scalar(_SCALARS[vtype][0], what)
            return bool(value) if vtype == 7 else value
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        raise GGUFImportError(f"{self.path}: file is corrupt: {what} has unknown value type {vtype}")

    def array(self, what: str) -> Any:
        etype = self.scalar("<I", what)
        count = self.scalar("<Q", what)
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            self.need(count * dtype.itemsize, what)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return values.astype(bool) if etype == 7 else values
        if etype == _STRING:
            # Each string is at least its 8-byte length: a cheap sanity bound before looping.
            self.need(count * 8, what)
            return [self.string(what) for _ in range(count)]
        if etype == _ARRAY:
            return [self.array(what) for _ in range(count)]
        raise GGUFImportError(f"{self.path}: file is corrupt: {what} has unknown element type {etype}")


def _type_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(qtype): sizes for qtype, sizes in GGML_QUANT_SIZES.items()}


def ggml_type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of ``path`` and check that every tensor lies inside the file."""
    path = Path(path)
    try:
        file_map = _map_file(path)
    except FileNotFoundError as exc:
        raise GGUFNotFoundError(f"{path}: no such file") from exc
    except ValueError as exc:  # mmap of an empty file
        raise GGUFImportError(f"{path}: file is empty, not a GGUF model") from exc
    except OSError as exc:
        raise GGUFImportError(f"{path}: cannot read file: {exc}") from exc

    cur = _Cursor(file_map, path)
    cur.need(4, "the GGUF magic")
    if bytes(file_map[:4]) != MAGIC:
        file_map.close()
        raise GGUFImportError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    cur.pos = 4
    version = cur.scalar("<I", "the version")
    if version not in (2, 3):
        # A byte-swapped version means a big-endian file, which llama.cpp also rarely produces.
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise GGUFImportError(
            f"{path}: unsupported GGUF version {version}{hint}; versions 2 and 3 are supported"
        )
    n_tensors = cur.scalar("<Q", "the tensor count")
    n_kv = cur.scalar("<Q", "the metadata count")

    metadata: dict[str, Any] = {}
    for index in range(n_kv):
        key = cur.string(f"metadata key #{index}")
        vtype = cur.scalar("<I", f"the type of {key!r}")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")

    sizes = _type_sizes()
    raw_infos = []
    for index in range(n_tensors):
        name = cur.string(f"tensor name #{index}")
        n_dims = cur.scalar("<I", f"tensor {name!r}")
        if n_dims > 8:
            raise GGUFImportError(f"{path}: file is corrupt: tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims)]
        ggml_type = cur.scalar("<I", f"tensor {name!r}")
        offset = cur.scalar("<Q", f"tensor {name!r}")
        raw_infos.append((name, dims, ggml_type, offset))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    data_start = -(-cur.pos // alignment) * alignment

    tensors = []
    for name, dims, ggml_type, offset in raw_infos:
        if ggml_type not in sizes:
            raise GGUFImportError(
                f"{path}: tensor {name!r} uses {ggml_type_name(ggml_type)}, "
                "which the importer cannot dequantize"
            )
        block, type_size = sizes[ggml_type]
        numel = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block:
            raise GGUFImportError(
                f"{path}: file is corrupt: tensor {name!r} row of {dims[0]} is not whole blocks"
            )
        n_bytes = numel // block * type_size
        start = data_start + offset
        if start + n_bytes > cur.size:
            raise GGUFImportError(
                f"{path}: file is truncated: tensor {name!r} needs bytes {start}..{start + n_bytes}, "
                f"but the file ends at {cur.size}"
            )
        tensors.append(TensorInfo(name, tuple(reversed(dims)), ggml_type, start, n_bytes))

    return GGUFFile(path, version, metadata, tensors, cur.size, file_map)
