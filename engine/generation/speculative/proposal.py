"""How a drafter with a distribution of its own (a draft model, MTP heads) picks a drafted token:
the argmax for a greedy job, else a draw at the job's temperature, whose distribution the
acceptance rule needs (``engine.generation.speculative.acceptance``)."""

from __future__ import annotations

import torch

from engine.generation.speculative.drafter import DraftRequest


def draft_generator(request: DraftRequest) -> torch.Generator | None:
    """The random stream of a sampled job's drafts (None for a greedy job): seeded from the job's
    seed where it has one, but never the job's own stream."""
    if request.temperature <= 0:
        return None
    generator = torch.Generator()
    seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, (1,)))
    generator.manual_seed(seed ^ 0x5EED)
    return generator


def pick(
    logits: torch.Tensor, temperature: float, vocab_size: int, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """The drafted token from the drafter's ``logits`` ``[vocab]``, and its proposal distribution
    over the target's ``vocab_size`` ids (None for a greedy pick: a point mass)."""
    x = logits.float().cpu()
    width = min(x.shape[-1], vocab_size)
    if temperature <= 0:
        return int(x[:width].argmax()), None
    q = torch.zeros(vocab_size, dtype=torch.float32)
    q[:width] = torch.softmax(x[:width] / temperature, dim=0)
    return int(torch.multinomial(q, 1, generator=generator)), q
