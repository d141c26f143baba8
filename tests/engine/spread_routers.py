"""Tiny AFMoE and Step 3.7 models (tiny_models.py) whose routers decide clearly, for parity tests;
and the check that they do.

transformers starts AFMoE's routers at zero, so every expert ties with every other, and Step's at
std 0.02 (logits within ~0.2 of each other); both start their selection biases at zero. Ours and
transformers' sums of the same numbers differ by ~1e-7, enough to swap two near-equal experts, and
a swapped expert changes a token's output wholesale. Here every router gets weights that spread
its logits by ~1.6 and every selection bias random values (so that it steers some choices), and
the model is saved again. :func:`smallest_margin` measures, on our model, how far each choice is
from flipping.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import build_tiny_model

from engine.cache.paged import PagedKVCache
from engine.generation.step import score_tokens
from engine.modules.moe import SparseMoE

# Each family's router weight and selection bias, by the end of their names in transformers.
ROUTERS = {
    "AfmoeForCausalLM": ("mlp.router.gate.weight", "mlp.expert_bias"),
    "Step3p7ForConditionalGeneration": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
}


def build_spread_model(variant: str, directory: Path, seed: int = 0):
    """:func:`build_tiny_model` with decisive routers; returns the transformers model."""
    model = build_tiny_model(variant, directory, seed)
    weight, bias = ROUTERS[variant]
    gen = torch.Generator().manual_seed(seed + 1)
    touched = 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(weight):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
                touched += 1
            elif name.endswith(bias):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    assert touched, f"{variant}: no router found"
    model.save_pretrained(directory)
    return model


def smallest_margin(model, ids: list[int]) -> float:
    """Over ``ids`` run through our ``model`` and each of its mixtures of experts: the least gap
    between a token's last chosen expert's selection score (biased) and its best unchosen one's."""
    gaps: list[float] = []

    def record(moe: SparseMoE, args, out) -> None:
        logits = moe.router(args[0]).float()
        scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
        if moe.selection_bias is not None:
            scores = scores + moe.selection_bias.float()
        top = scores.topk(moe.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    moes = [m for m in model.module.modules() if isinstance(m, SparseMoE)]
    hooks = [m.register_forward_hook(record) for m in moes]
    try:
        score_tokens(model.module, PagedKVCache.for_model(model.spec, len(ids) + 16, page_size=16), ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(gaps) == len(moes)
    return min(gaps)
