"""A ``ModelInfo`` as the inspector would describe a model, without files: a 10-layer BF16 model of
20 GiB (19 GiB in its layers), 4 KV heads of 128, for placement and memory-estimate tests."""

from __future__ import annotations

from pathlib import Path

from engine.inspect import ModelInfo

GIB = 1 << 30


def model_info(**fields) -> ModelInfo:
    """The model above, with ``fields`` replaced (any ``ModelInfo`` field)."""
    values = dict(
        path=Path("m"),
        name="m",
        quantization="BF16",
        weight_bytes=20 * GIB,
        layer_weight_bytes=19 * GIB,
        num_layers=10,
        num_kv_heads=4,
        head_dim=128,
        context_length=4096,
    )
    return ModelInfo(**{**values, **fields})
