"""Drafters for tests: ones whose guesses are right or wrong where the test wants them to be."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from engine.generation.speculative.drafter import Draft, Drafter, DraftRequest


class OracleDrafter(Drafter):
    """Knows each prompt's plain continuation (``answers``: prompt tuple -> tokens) and proposes
    it, each token replaced by a wrong one with probability ``wrong`` (seeded): drafts that are
    kept whole, cut short at any position, or rejected at once, as the test needs."""

    kind = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong: float = 0.3, seed: int = 0) -> None:
        self.answers, self.wrong = answers, wrong
        self.random = torch.Generator().manual_seed(seed)
        self.requests = 0

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            self.requests += 1
            tokens = list(request.tokens)
            guess = []
            for prompt, answer in self.answers.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    done = len(tokens) - len(prompt)
                    guess = list(answer[done : done + request.max_tokens])
                    break
            for i in range(len(guess)):
                if float(torch.rand(1, generator=self.random)) < self.wrong:
                    guess[i] = (guess[i] + 1 + int(torch.randint(0, 5, (1,), generator=self.random))) % 300
            drafts.append(Draft(guess))
        return drafts

    def forget(self, key: Hashable) -> None:
        pass


class FixedProposalDrafter(Drafter):
    """Draws each drafted token from one fixed distribution ``q`` (float ``[vocab]``), as a draft
    model with a (bad) distribution of its own would, and says so: the acceptance rule must keep
    the target's distribution exact whatever ``q`` is."""

    kind = "fixed"

    def __init__(self, q: torch.Tensor, tokens: int = 2, seed: int = 0) -> None:
        self.q = (q / q.sum()).float()
        self.tokens = tokens
        self.random = torch.Generator().manual_seed(seed)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            k = min(self.tokens, request.max_tokens)
            ids = torch.multinomial(self.q, k, replacement=True, generator=self.random).tolist()
            drafts.append(Draft(ids, self.q.expand(k, -1).clone()))
        return drafts
