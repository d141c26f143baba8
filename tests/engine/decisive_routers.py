"""Tiny mixture-of-experts models whose routers decide clearly, for parity tests.

transformers initialises a router with weights of std 0.02: over a 64-wide hidden state every
expert's logit is within ~0.2 of the others, and its correction bias is zero. Two sums of the
same numbers in another order (ours and transformers') then differ by ~1e-7, enough to swap two
near-equal experts now and then, and a swapped expert changes a token's output wholesale. Here
the routers are scaled up (logits spread by ~1.6) and the correction biases made random (so that
they steer some choices), and the model is saved again.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import build_tiny_model

# The families whose tiny models (tiny_models.py) are built through here.
ROUTED_MOE = ["Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Ernie4_5_MoeForCausalLM", "Dots1ForCausalLM"]
ROUTER_GAIN = 10.0


def build_routed_tiny_model(variant: str, directory: Path, seed: int = 0):
    """:func:`build_tiny_model` with decisive routers; returns the transformers model."""
    model = build_tiny_model(variant, directory, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    touched = 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                t.mul_(ROUTER_GAIN)
                touched += 1
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    assert touched, f"{variant}: no router found"
    model.save_pretrained(directory)
    return model
