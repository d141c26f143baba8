"""The EXL3 format at run time: decoding (codebooks, trellis, Hadamard, reconstruct), the EXL3
linear layer, the ``quantization_config`` reader. Writing the format is the converter's
(:mod:`engine.convert`), which loading a model never imports.

The two calls a weight loader needs (one per linear)::

    if is_exl3_linear(keys, prefix):
        layer = load_exl3_linear(get_tensor, prefix, in_features, out_features, mode="dense", keys=keys)

Format reference: ``docs/EXL3_FORMAT.md`` (section numbers in docstrings refer to it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from engine.errors import ModelLoadError
from engine.exl3.config import EXL3QuantConfig, load_quantization_config, parse_quantization_config
from engine.exl3.errors import (
    MissingTensorError,
    QuantFormatError,
    TensorShapeError,
    UnsupportedQuantFormatError,
)
from engine.exl3.exl3_linear import EXL3Linear

__all__ = [
    "EXL3Linear",
    "EXL3QuantConfig",
    "MissingTensorError",
    "QuantFormatError",
    "TensorShapeError",
    "UnsupportedQuantFormatError",
    "exl3_tensor_names",
    "is_exl3_linear",
    "load_exl3_linear",
    "load_quantization_config",
    "parse_quantization_config",
]

# Every tensor an EXL3 linear may store (section 3.1, 3.2). "scale" is a pre-release global
# scalar that the reference never reads; it is listed so loaders know it belongs to the layer.
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias", "scale")
_OPTIONAL = ("suh", "su", "svh", "sv", "mcg", "mul1", "bias")


def is_exl3_linear(keys: Collection[str], prefix: str) -> bool:
    """True iff ``prefix`` is an EXL3 linear (section 1).

    That is: ``trellis`` plus (``suh`` or ``su``) plus (``svh`` or ``sv``) are stored under it.
    """
    return (
        f"{prefix}.trellis" in keys
        and (f"{prefix}.suh" in keys or f"{prefix}.su" in keys)
        and (f"{prefix}.svh" in keys or f"{prefix}.sv" in keys)
    )


def exl3_tensor_names(keys: Collection[str], prefix: str) -> list[str]:
    """The tensor names under ``prefix`` that belong to its EXL3 linear (for "unused tensor" checks)."""
    return [f"{prefix}.{s}" for s in EXL3_SUFFIXES if f"{prefix}.{s}" in keys]


def load_exl3_linear(
    get_tensor: Callable[[str], torch.Tensor],
    prefix: str,
    in_features: int,
    out_features: int,
    mode: str = "dense",
    keys: Collection[str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> EXL3Linear:
    """Build the :class:`EXL3Linear` stored under ``prefix`` (e.g. ``model.layers.0.mlp.up_proj``).

    ``get_tensor(name)`` returns a stored tensor. Pass ``keys`` (all tensor names of the
    checkpoint) so optional tensors (flags, bias, legacy scales) are looked up by presence;
    without it, each optional name is tried and a ``KeyError`` or ``ModelLoadError`` (what a
    weight store raises for an unknown name) means absent.
    ``device``: where decoding runs and the result lives (default: where ``get_tensor`` puts it).
    ``in_features``/``out_features`` are the HF layer's true sizes (stored dims may be padded).
    """
    tensors: dict[str, torch.Tensor] = {}

    def fetch(suffix: str, required: bool) -> None:
        name = f"{prefix}.{suffix}"
        if keys is not None and name not in keys:
            if required:
                raise MissingTensorError(f"EXL3 linear {prefix!r}: tensor {name!r} is not in the checkpoint")
            return
        try:
            t = get_tensor(name)
        except (KeyError, ModelLoadError):
            if required:
                raise MissingTensorError(
                    f"EXL3 linear {prefix!r}: tensor {name!r} is not in the checkpoint"
                ) from None
            return
        tensors[suffix] = t.to(device) if device is not None else t

    fetch("trellis", required=True)
    for suffix in _OPTIONAL:
        fetch(suffix, required=False)
    return EXL3Linear.from_tensors(
        tensors, in_features, out_features, bias=None, mode=mode, dtype=dtype, name=prefix
    )
