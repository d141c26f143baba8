"""What the parity tests against transformers share: the relative error of two tensors, random
prompt ids, and transformers' logits for a prompt."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` over the whole tensors."""
    return ((a - b).norm() / b.norm()).item()


def random_ids(n: int, seed: int = 1, high: int = 320) -> list[int]:
    """``n`` token ids in ``[3, high)`` (above the tiny tokenizers' special ids), reproducibly."""
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(ids), vocab]`` for one prompt."""
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()
