"""The tiny DeepSeek-V3 models of tests/engine/tiny_models.py with routers that decide clearly
(decisive_routers.py: wide router logits, random selection biases), and :func:`routing_margin`,
which measures on the very tokens a test runs how far every routing choice is from a tie, in
transformers' own forward pass. The tests assert it is far above float32 rounding, so a parity
failure is never a coin flip between two equally scored experts or groups.
"""

from __future__ import annotations

from pathlib import Path

import torch
from decisive_routers import build_routed_tiny_model

VARIANTS = ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM-plain")
ROUTER = "DeepseekV3TopkRouter"


def build_tiny_deepseek(variant: str, directory: Path, seed: int = 0):
    """The tiny model of ``variant`` with decisive routers, saved to ``directory``; returns the
    transformers model."""
    return build_routed_tiny_model(variant, directory, seed)


def _margins(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Per token, the smallest gap between a kept and a dropped group (by the sum of its two best
    biased scores) and between a chosen and an unchosen expert among the kept groups."""
    logits = torch.nn.functional.linear(
        hidden.reshape(-1, router.weight.shape[1]).float(), router.weight.float()
    )
    biased = logits.sigmoid() + router.e_score_correction_bias
    groups = biased.view(biased.shape[0], router.num_group, -1)
    gaps = []
    if router.num_group > 1:
        worth = groups.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
        gaps.append(worth[:, router.topk_group - 1] - worth[:, router.topk_group])
        kept = groups.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
        mask = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, kept, True)
        biased = groups.masked_fill(~mask[..., None], float("-inf")).reshape(biased.shape)
    ranked = biased.sort(dim=-1, descending=True).values
    gaps.append(ranked[:, router.top_k - 1] - ranked[:, router.top_k])
    return torch.stack(gaps).min(dim=0).values


def routing_margin(model, ids: list[int]) -> tuple[float, int]:
    """The smallest routing margin (:func:`_margins`) over every token of ``ids`` and every MoE
    layer, in transformers' forward pass over ``ids``; and how many different sets of experts the
    tokens chose in all (several: the routing really depends on the token)."""
    margins: list[float] = []
    choices: set[tuple[int, ...]] = set()

    def record(module, args, out) -> None:
        margins.append(float(_margins(module, args[0]).min()))
        choices.update(tuple(sorted(row)) for row in out[2].tolist())

    routers = [m for m in model.modules() if type(m).__name__ == ROUTER]
    hooks = [r.register_forward_hook(record) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(margins) == len(routers) > 0
    return min(margins), len(choices)
