"""Int8 weights with one scale per output row: the compact format of imported GGUF models.

A quantized matrix ``name`` ([rows, cols], e.g. ``model.layers.0.mlp.up_proj.weight``) is stored as
two safetensors tensors:

- ``name``: int8 ``[rows, cols]``, the codes, symmetric in -127..127;
- ``name_scale``: float ``[rows]``, each row's step: ``W[r, c] = name[r, c] * name_scale[r]``.

config.json names the format in ``quantization_config`` (:func:`quantization_config`); tensors
that are not matrices (norms, biases) stay unquantized. A read of ``name`` through the weight
store gives the dequantized matrix, so any module that wants plain weights gets them; linears and
embeddings on the CPU keep the codes and multiply on the fly (``engine.modules.int8``), and a GPU
dequantizes them once at load.

This module imports torch only where it reads tensors: the model inspector (torch-free) asks
:func:`is_int8_config`.

The importer picks each scale as ``max |W[r]| / 127`` rounded up to a bfloat16 value: the CPU's
int8 matmul takes its scales in bfloat16, and a scale that bfloat16 holds exactly keeps that path
free of a second rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

QUANT_METHOD = "int8"
SCALE_SUFFIX = "_scale"
LIMIT = 127  # symmetric codes: -128 is never written


def quantization_config() -> dict[str, Any]:
    """The ``quantization_config`` of config.json for this format."""
    return {"quant_method": QUANT_METHOD, "bits": 8, "group_size": -1, "symmetric": True}


def is_int8_config(quantization: Mapping[str, Any] | None) -> bool:
    """Whether a ``quantization_config`` names this format."""
    return bool(quantization) and str(quantization.get("quant_method", "")).lower() == QUANT_METHOD


def check_config(quantization: Mapping[str, Any], source: str) -> None:
    """Refuse an int8 ``quantization_config`` this reader does not implement (say, scales per
    group of columns), naming ``source``."""
    bits, group, symmetric = (quantization.get(k) for k in ("bits", "group_size", "symmetric"))
    if bits not in (None, 8) or group not in (None, -1) or symmetric not in (None, True):
        raise ModelLoadError(
            f"{source}: int8 quantization with bits={bits}, group_size={group}, symmetric={symmetric} "
            "is not supported (this engine reads 8-bit symmetric codes with one scale per output row)"
        )


# -- writing (numpy: the GGUF importer) ---------------------------------------------------------


def quantize_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes int8 [rows, cols], scales float32 [rows])`` of a float matrix."""
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"int8 quantization takes a matrix, got shape {list(w.shape)}")
    scale = _round_up_to_bfloat16(np.abs(w).max(axis=1) / np.float32(LIMIT))
    safe = np.where(scale > 0, scale, np.float32(1))  # an all-zero row: codes 0, scale 0
    codes = np.clip(np.rint(w / safe[:, None]), -LIMIT, LIMIT).astype(np.int8)
    return codes, scale


def _round_up_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """The smallest bfloat16 values >= ``values`` (finite, non-negative float32), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    low = bits & np.uint32(0xFFFF)
    up = (bits & np.uint32(0xFFFF0000)) + np.where(low != 0, np.uint32(0x10000), np.uint32(0))
    return up.astype(np.uint32).view(np.float32)


# -- reading (torch: the weight store) -----------------------------------------------------------


def scale_pairs(keys: Iterable[str], dtype_of: Callable[[str], str]) -> dict[str, str]:
    """``{name: name_scale}`` for every int8 tensor among ``keys`` that has a scale tensor there.
    ``dtype_of(key)``: a stored tensor's safetensors dtype tag ("I8", "F32", ...)."""
    keys = set(keys)
    return {k: k + SCALE_SUFFIX for k in keys if k + SCALE_SUFFIX in keys and dtype_of(k) == "I8"}


def check_pair(name: str, codes: torch.Tensor, scale: torch.Tensor, where: str) -> None:
    """Raise :class:`ModelLoadError` unless ``scale`` can scale the rows of ``codes``: a float
    vector of one finite, non-negative value per row. ``where`` names the model folder."""
    import torch

    problem = None
    if codes.dim() != 2:
        problem = f"int8 tensor '{name}' has shape {list(codes.shape)}; only matrices can have row scales"
    elif not scale.is_floating_point():
        problem = f"its dtype is {str(scale.dtype).removeprefix('torch.')}, not a float type"
    elif list(scale.shape) != [codes.shape[0]]:
        problem = f"its shape is {list(scale.shape)}, expected [{codes.shape[0]}] (one per row of '{name}')"
    elif not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        problem = "it holds negative, infinite or NaN values"
    if problem is not None:
        raise ModelLoadError(f"corrupt scale tensor '{name}{SCALE_SUFFIX}' in {where}: {problem}")


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The matrix ``codes * scale[:, None]`` in ``dtype`` (float32 if None; computed in float32)."""
    import torch

    dtype = dtype or torch.float32
    return (codes.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)
