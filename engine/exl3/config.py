"""``quantization_config`` of an EXL3 model directory (docs/EXL3_FORMAT.md section 2).

The decoder never needs this object (a linear is EXL3 iff its tensors say so, section 1); we
read it to reject what we cannot load with a clear message, to report bits/codebook to the
user, and to cross-check the safetensors headers against ``tensor_storage`` when present.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.exl3.errors import (
    MissingTensorError,
    QuantFormatError,
    TensorShapeError,
    UnsupportedQuantFormatError,
)

QUANT_METHOD = "exl3"
# Decoding has been unchanged from the first public release (0.0.x) through 1.4.1 (section 8).
# A new major version is the signal the format may have changed, so we refuse it loudly rather
# than decode garbage.
SUPPORTED_MAJOR_VERSIONS = (0, 1)


@dataclass(frozen=True)
class StoredTensor:
    """One entry of ``tensor_storage[module]["stored_tensors"]``."""

    shape: tuple[int, ...]
    n_bytes: int
    dtype: str


@dataclass(frozen=True)
class ModuleStorage:
    """``tensor_storage`` entry of one leaf module."""

    key: str
    stored_tensors: dict[str, StoredTensor]
    quant_format: str | None = None
    bits_per_weight: int | None = None


@dataclass(frozen=True)
class EXL3QuantConfig:
    """The parsed ``quantization_config`` (plus ``tensor_storage`` when it was available)."""

    version: str | None
    bits: float | None
    head_bits: int | None
    codebook: str | None = None
    out_scales: str | None = None
    calibration: dict[str, int] | None = None
    original_quantization_config: dict[str, Any] | None = None
    tensor_storage: dict[str, ModuleStorage] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def head_quantized(self) -> bool:
        """False when the head was kept at 16 bits (``head_bits = 16``, section 2)."""
        return self.head_bits is None or self.head_bits < 16


def parse_version(version: str) -> tuple[int, ...]:
    """``"1.4.1"`` -> ``(1, 4, 1)``; trailing non-numeric parts (``"0.0.9.dev0"``) are dropped."""
    parts = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    if not parts:
        raise ValueError(f"not a version: {version!r}")
    return tuple(parts)


def _parse_tensor_storage(obj: Any, source: str) -> dict[str, ModuleStorage]:
    if not isinstance(obj, Mapping):
        raise QuantFormatError(f"{source}: 'tensor_storage' must be an object")
    modules: dict[str, ModuleStorage] = {}
    for key, entry in obj.items():
        try:
            tensors = {
                name: StoredTensor(tuple(int(d) for d in t["shape"]), int(t["n_bytes"]), str(t["dtype"]))
                for name, t in entry["stored_tensors"].items()
            }
            bpw = entry.get("bits_per_weight")
            modules[key] = ModuleStorage(
                key=key,
                stored_tensors=tensors,
                quant_format=entry.get("quant_format"),
                bits_per_weight=int(bpw) if bpw is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise QuantFormatError(f"{source}: malformed tensor_storage entry {key!r}: {exc}") from exc
    return modules


def parse_quantization_config(obj: Mapping[str, Any], source: str = "config.json") -> EXL3QuantConfig:
    """Validate and parse a ``quantization_config`` object (optionally with ``tensor_storage``).

    Raises :class:`UnsupportedQuantFormatError` for a non-EXL3 method or an unsupported version,
    :class:`QuantFormatError` for malformed fields. ``source`` names the file in messages.
    """
    if not isinstance(obj, Mapping):
        raise QuantFormatError(f"{source}: quantization_config must be an object, got {type(obj).__name__}")
    method = obj.get("quant_method")
    if method != QUANT_METHOD:
        raise UnsupportedQuantFormatError(
            f"{source}: quantization method {method!r} is not supported (only EXL3 models can be loaded)"
        )
    version = obj.get("version")
    if version is not None:
        try:
            parsed = parse_version(str(version))
        except ValueError as exc:
            raise QuantFormatError(f"{source}: unreadable EXL3 version {version!r}") from exc
        if parsed[0] not in SUPPORTED_MAJOR_VERSIONS:
            supported = "/".join(f"{v}.x" for v in SUPPORTED_MAJOR_VERSIONS)
            raise UnsupportedQuantFormatError(
                f"{source}: EXL3 format version {version} is not supported (this engine reads {supported})"
            )
    try:
        bits = float(obj["bits"]) if obj.get("bits") is not None else None
        head_bits = int(obj["head_bits"]) if obj.get("head_bits") is not None else None
    except (TypeError, ValueError) as exc:
        raise QuantFormatError(f"{source}: 'bits'/'head_bits' must be numbers: {exc}") from exc
    if head_bits is not None and not (1 <= head_bits <= 8 or head_bits == 16):
        raise QuantFormatError(f"{source}: head_bits must be 1..8 or 16, got {head_bits}")
    codebook = obj.get("codebook")
    if codebook is not None and str(codebook).lower() not in ("mul1", "mcg", "3inst"):
        raise UnsupportedQuantFormatError(f"{source}: unknown EXL3 codebook {codebook!r}")
    storage = obj.get("tensor_storage")
    return EXL3QuantConfig(
        version=str(version) if version is not None else None,
        bits=bits,
        head_bits=head_bits,
        codebook=str(codebook).lower() if codebook is not None else None,
        out_scales=obj.get("out_scales"),
        calibration=dict(obj["calibration"]) if isinstance(obj.get("calibration"), Mapping) else None,
        original_quantization_config=obj.get("original_quantization_config"),
        tensor_storage=_parse_tensor_storage(storage, source) if storage is not None else None,
        raw=dict(obj),
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantFormatError(f"{path}: cannot read JSON: {exc}") from exc


def load_quantization_config(model_dir: str | Path) -> EXL3QuantConfig | None:
    """Read the EXL3 config of a model directory, or None for an unquantized model.

    ``config.json["quantization_config"]`` is authoritative; ``quantization_config.json`` adds
    ``tensor_storage`` (and stands in when config.json lacks the object).
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    qc_path = model_dir / "quantization_config.json"
    main = None
    if config_path.is_file():
        cfg = _read_json(config_path)
        if isinstance(cfg, Mapping):
            main = cfg.get("quantization_config")
    extra = _read_json(qc_path) if qc_path.is_file() else None
    if main is None and extra is None:
        return None
    if main is None:
        return parse_quantization_config(extra, str(qc_path))
    if isinstance(extra, Mapping) and "tensor_storage" in extra and "tensor_storage" not in main:
        main = {**main, "tensor_storage": extra["tensor_storage"]}
    return parse_quantization_config(main, str(config_path))


def check_tensor_storage(config: EXL3QuantConfig, header_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check that every tensor listed in ``tensor_storage`` is in the checkpoint, with that shape.

    ``header_shapes`` maps tensor names to shapes as read from the safetensors headers. A file
    that lost a shard or was truncated fails here with the first missing/mismatched name.
    """
    if not config.tensor_storage:
        return
    for module in config.tensor_storage.values():
        for name, info in module.stored_tensors.items():
            if name not in header_shapes:
                raise MissingTensorError(
                    f"tensor {name!r} of module {module.key!r} is listed in quantization_config.json "
                    "but is not in any safetensors file"
                )
            shape = tuple(header_shapes[name])
            if shape != info.shape:
                raise TensorShapeError(
                    f"tensor {name!r} has shape {list(shape)} in the safetensors file but "
                    f"{list(info.shape)} in quantization_config.json"
                )
