"""How many tokens to draft: adapt to how many were accepted lately.

A verify step of ``1 + k`` tokens costs more than a plain decode step, a little per extra token
(``extra_token_cost``, a fraction of a one-token step: small where a step reads weights and not
activations, as decode steps do), and yields on average ``(1 - a^(k+1)) / (1 - a)`` tokens when
each drafted token is accepted with probability ``a``. The controller keeps an exponential moving
average of ``a`` per sequence (over drafted tokens) and drafts the ``k`` that maximises tokens per
unit of step cost, between ``1`` and ``max_tokens``. A drafter with no guess costs nothing (no
extra rows), so drafting never stops outright: a sequence whose drafts keep failing drafts one
token at a time, which costs ``extra_token_cost`` of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

# What one more token costs a decode step, as a share of the step, on either device. GPU (H100,
# CUDA graphs, 8B shape at 4 bpw): 1 + k tokens cost 1.28x one at k = 1, 1.82x at k = 4 and 2.06x
# at k = 8 (docs/SPECULATIVE.md); CPU (SmolLM2-135M on two cores): 5 tokens cost 1.5x one, 9
# tokens 2.4x.
EXTRA_TOKEN_COST = 0.2


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step of ``k`` drafts yields on average at per-token acceptance ``a``."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_length(a: float, max_tokens: int, extra_token_cost: float) -> int:
    """The draft length in ``1..max_tokens`` with the most tokens per unit of step cost."""
    return max(
        range(1, max_tokens + 1), key=lambda k: (expected_tokens(a, k) / (1.0 + extra_token_cost * k), -k)
    )


@dataclass
class DraftLength:
    """One sequence's acceptance estimate and the draft length it implies."""

    max_tokens: int
    extra_token_cost: float = EXTRA_TOKEN_COST
    rate: float = 0.6  # prior: drafts are worth trying at first
    smoothing: float = 0.3  # weight of the newest step's acceptance in the average

    @property
    def tokens(self) -> int:
        return best_length(self.rate, self.max_tokens, self.extra_token_cost)

    def update(self, drafted: int, accepted: int) -> None:
        """A verify step checked ``drafted`` tokens and kept the first ``accepted`` of them. The
        rate counts a step's accepted run against what it had to accept: a draft stops at its
        first miss, so ``accepted / (accepted + 1)`` when it missed, 1 when all were kept."""
        if drafted <= 0:
            return
        observed = 1.0 if accepted >= drafted else accepted / (accepted + 1.0)
        self.rate += self.smoothing * (observed - self.rate)
