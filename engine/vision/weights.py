"""Reading a vision tower's weights: always dense, in the model's dtype.

Towers are small next to the language model and sensitive to quantization, so an EXL3
conversion copies them unquantized; this reader only ever looks for ``.weight``/``.bias``.
"""

from __future__ import annotations

import torch

from engine.loading.safetensors_store import WeightStore
from engine.modules.layer_norm import LayerNorm
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.norms import RMSNorm


class TowerWeights:
    def __init__(self, store: WeightStore, prefix: str, dtype: torch.dtype, device: torch.device) -> None:
        self.store, self.prefix, self.dtype, self.device = store, prefix, dtype, device

    def under(self, prefix: str) -> TowerWeights:
        return TowerWeights(self.store, prefix, self.dtype, self.device)

    def has(self, key: str) -> bool:
        return self.store.has(self.prefix + key)

    def tensor(self, key: str) -> torch.Tensor:
        return self.store.get(self.prefix + key, dtype=self.dtype, device=self.device)

    def optional(self, key: str) -> torch.Tensor | None:
        return self.tensor(key) if self.has(key) else None

    def linear(self, key: str) -> DenseLinear:
        return DenseLinear(self.tensor(f"{key}.weight"), self.optional(f"{key}.bias"))

    def projections(self, *keys: str) -> ProjectionGroup:
        """Separate projections of one input (q, k, v)."""
        parts = []
        for key in keys:
            linear = self.linear(key)
            parts.append((linear, [linear.out_features]))
        return ProjectionGroup(parts)

    def fused(self, key: str, parts: int) -> ProjectionGroup:
        """One matrix holding ``parts`` equal projections (a fused qkv)."""
        linear = self.linear(key)
        return ProjectionGroup([(linear, [linear.out_features // parts] * parts)])

    def layer_norm(self, key: str, eps: float) -> LayerNorm:
        return LayerNorm(self.tensor(f"{key}.weight"), self.optional(f"{key}.bias"), eps)

    def rms_norm(self, key: str, eps: float, offset: float = 0.0) -> RMSNorm:
        return RMSNorm(self.tensor(f"{key}.weight"), eps, offset)


def first_prefix(store: WeightStore, candidates: list[str], probe: str) -> str:
    """The first of ``candidates`` under which ``probe`` exists: checkpoints of one family are
    saved with different nestings (by the original authors, by transformers 4 and 5)."""
    for prefix in candidates:
        if store.has(prefix + probe):
            return prefix
    from engine.errors import ModelLoadError

    raise ModelLoadError(f"vision weights not found: no '{probe}' under any of {candidates}")
