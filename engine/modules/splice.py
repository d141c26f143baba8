"""Inputs given as vectors rather than token ids: image embeddings spliced into a forward step.

A multimodal prompt's image placeholders are ordinary tokens in the sequence (so the cache,
batching and prefix reuse treat them like any other), but their input rows come from a vision
tower instead of the embedding table. Some families also add vision features to the residual
stream after early decoder layers (Qwen3-VL's "deepstack").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class InputSplice:
    """Rows of one forward step's flat batch whose input is given, not looked up by token id.

    ``values`` replace the embeddings at ``rows``; ``layer_additions[i]`` (if present) is added at
    ``rows`` after decoder layer ``i``.
    """

    rows: torch.Tensor
    values: torch.Tensor
    layer_additions: list[torch.Tensor] = field(default_factory=list)

    def to(self, device: torch.device | str) -> InputSplice:
        return InputSplice(
            self.rows.to(device), self.values.to(device), [a.to(device) for a in self.layer_additions]
        )

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[self.rows] = self.values.to(h.dtype)
        return h

    def after_layer(self, index: int, h: torch.Tensor) -> torch.Tensor:
        if index >= len(self.layer_additions):
            return h
        h = h.clone()
        h[self.rows] += self.layer_additions[index].to(h.dtype)
        return h

    @staticmethod
    def merge(parts: Sequence[InputSplice]) -> InputSplice | None:
        parts = [p for p in parts if p.rows.numel()]
        if not parts:
            return None
        depth = max(len(p.layer_additions) for p in parts)
        additions = []
        for i in range(depth):
            additions.append(
                torch.cat(
                    [
                        p.layer_additions[i] if i < len(p.layer_additions) else torch.zeros_like(p.values)
                        for p in parts
                    ]
                )
            )
        return InputSplice(
            torch.cat([p.rows for p in parts]), torch.cat([p.values for p in parts]), additions
        )
