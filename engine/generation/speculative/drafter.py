"""What a drafter is: something that guesses the next few tokens of a sequence cheaply.

The generator asks once per step for every decoding job that may take a draft
(:meth:`Drafter.propose`, one call for the batch, so a draft model can run its own steps batched),
then verifies the guesses with the target model in the same step as everything else
(``engine.generation.speculative.speculation``). A drafter keeps what it needs per sequence
(an n-gram index, a draft model's cache) under the request's ``key`` until :meth:`Drafter.forget`.

A draft names its proposal distribution where it has one (``q``: a draft model's sampling
distribution per drafted position); without one the proposal is deterministic (a point mass on
each drafted token: n-gram lookup, any greedy drafter). The acceptance rule
(``engine.generation.speculative.acceptance``) keeps the target's distribution exact either way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's ask: its ``tokens`` so far (prompt and reply), at most ``max_tokens`` to
    guess, and the job's ``temperature`` (0: its tokens are argmaxes; a drafter with a
    distribution of its own may propose from it at that temperature)."""

    key: Hashable
    tokens: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class Draft:
    """Guessed ``tokens`` (possibly none) and, where proposed by sampling, ``q`` float32
    ``[len(tokens), vocab]``: each position's proposal probabilities (None: a point mass on each
    token)."""

    tokens: list[int]
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def proposal(self, i: int) -> torch.Tensor | None:
        """Position ``i``'s proposal distribution, None for a point mass."""
        return None if self.q is None else self.q[i]


NO_DRAFT = Draft([])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: how far a drafter's state for a sequence
    still holds after the target kept or rejected its drafts."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, compared at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Observation:
    """What a target step computed for one sequence, for a drafter that reads the target's hidden
    states (:attr:`Drafter.wants_hidden`): the step fed ``inputs`` from position ``start`` on and
    computed their final ``hidden`` states ``[len(inputs), hidden]``; the sequence's ``tokens``
    are what it holds after the step (kept drafts and the target's token included). Positions
    whose input is not among ``tokens`` any more (rejected drafts) are stale."""

    key: Hashable
    tokens: Sequence[int]
    start: int
    inputs: Sequence[int]
    hidden: torch.Tensor


class Drafter:
    """Base class: ``kind`` names it in statistics and errors."""

    kind = "drafter"
    # Whether the target's steps hand it their final hidden states (:meth:`observe`): opt-in, since
    # such steps run the general step path (no fixed-shape decode, no CUDA graphs).
    wants_hidden = False

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request (of at most its ``max_tokens``; empty when there is no guess)."""
        raise NotImplementedError

    def forget(self, key: Hashable) -> None:
        """The sequence ``key`` is over (or was rewound): drop what is kept for it."""

    def observe(self, seen: Sequence[Observation]) -> None:
        """After a target step (only where :attr:`wants_hidden`): what it computed per sequence."""
