"""Will this model fit? One line for the chat's model picker: the model's quantization, the memory
it needs (the library's estimate for the context it will be loaded with) and the verdict in words."""

from __future__ import annotations

from engine.inspect import MemoryVerdict, ModelInfo
from engine.units import format_bytes

FIT_WORDS = {
    "fits": "✓ fits in memory",
    "tight": "⚠ tight: close other programs first",
    "too big": "✕ too big for this machine's memory",
    "unknown": "memory free unknown",
}


def fit_text(info: ModelInfo, verdict: MemoryVerdict) -> str:
    """E.g. "Q4_1 · ≈ 256.3 MiB · ✓ fits in memory"."""
    quantization = info.quantization or "precision unknown"
    words = FIT_WORDS.get(verdict.verdict, verdict.verdict)
    return f"{quantization} · ≈ {format_bytes(verdict.needed_bytes)} · {words}"
