"""Inputs shared by the generator tests on the CPU and the GPU: random prompts for the tiny models
and a set of sampling settings that exercises every rule the samplers have."""

from __future__ import annotations

import torch

from engine.generation.sampling import SamplingSettings

# Seeded sampling with each penalty and truncation rule, and penalised greedy.
SAMPLED_SETTINGS = [
    SamplingSettings(temperature=0.9, seed=1),
    SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=2),
    SamplingSettings(temperature=1.2, min_p=0.05, presence_penalty=0.8, frequency_penalty=0.5, seed=3),
    SamplingSettings(temperature=0.0, repetition_penalty=4.0, frequency_penalty=0.3),  # penalised greedy
    SamplingSettings(temperature=1.0, top_p=0.5, repetition_penalty=2.0, frequency_penalty=1.0, seed=5),
]


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """One prompt of random token ids (3..319, inside every tiny vocabulary) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]
