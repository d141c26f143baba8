"""Quantization formats the engine reads as plain weights, dequantized on load (torch-free: the
model inspector asks too). A checkpoint in one of them loads, and converts, like an unquantized
one; any other ``quant_method`` but EXL3 is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# MXFP4: gpt-oss's experts on the Hub (engine.loading.mxfp4).
METHODS = frozenset({"mxfp4"})


def dequantized_on_load(quantization: Mapping[str, Any] | None) -> bool:
    """Whether a config's ``quantization_config`` names a format in :data:`METHODS`."""
    return bool(quantization) and str(quantization.get("quant_method", "")).lower() in METHODS
