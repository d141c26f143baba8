"""Speculative sampling keeps the target's distribution: the acceptance rule alone, against the
exact distribution, and the Generator with drafts against the Generator without, on a trained
tiny hybrid model at temperature 1. Each check runs once more with a deliberately wrong rule
(after a rejection, draw from p instead of the residual max(0, p - q)) and must then fail.

Threshold: a check passes when its chi-square p-value is >= 1e-3 (a correct rule fails it one
run in a thousand; every draw here is seeded, so a run is reproducible); the wrong rule must give
p < 1e-3. The sample sizes make the wrong rule's bias (it over-weights tokens that q and p share)
tens of standard deviations wide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chi_square import goodness_of_fit, homogeneity
from drafters import FixedProposalDrafter

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import Sampler, SamplingSettings
from engine.generation.speculative import acceptance
from engine.model import load_model

THRESHOLD = 1e-3
TRAINED_HYBRID = Path(__file__).parents[1] / "data" / "tiny-hybrids" / "qwen3_5"


@pytest.fixture
def wrong_rule(monkeypatch):
    """After a rejection, draw from the target's p itself instead of the residual: the classic
    mistake, which over-weights the tokens the proposal already had its chance at."""
    monkeypatch.setattr(acceptance, "residual", lambda p, draft, q: p.clone())


def _rule_counts(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int) -> torch.Tensor:
    """Tokens out of the acceptance rule for ``n`` drafts from ``q`` (None: always p's argmax, a
    point mass)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, 3, generator=g, dtype=torch.float64)
    counts = torch.zeros(p.numel())
    for i in range(n):
        if q is None:
            draft = int(p.argmax())
        else:
            draft = int(torch.searchsorted(q.cumsum(0), u[i, :1]).clamp(max=p.numel() - 1))
        counts[acceptance.accept_or_resample(p, draft, q, float(u[i, 1]), float(u[i, 2]))] += 1
    return counts


def _distributions(seed: int, vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5, 0)
    q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5, 0)
    return p, q


@pytest.mark.parametrize("point_mass", [False, True])
def test_the_rule_reproduces_the_target_distribution(point_mass: bool) -> None:
    p, q = _distributions(0)
    counts = _rule_counts(p, None if point_mass else q, 8000, seed=1)
    assert goodness_of_fit(counts, p) >= THRESHOLD


@pytest.mark.parametrize("point_mass", [False, True])
def test_the_check_fails_for_a_wrong_rule(wrong_rule, point_mass: bool) -> None:
    p, q = _distributions(0)
    counts = _rule_counts(p, None if point_mass else q, 8000, seed=1)
    assert goodness_of_fit(counts, p) < THRESHOLD


def test_the_sampler_picks_by_the_rule_from_its_processed_distribution() -> None:
    # With min-p the target distribution has only a few tokens: a draft outside them is never
    # kept, and the tokens come out in the truncated softmax's proportions.
    logits = torch.tensor([2.0, 1.5, 1.0, -3.0, -4.0, 0.5])
    sampler = Sampler(SamplingSettings(temperature=1.0, min_p=0.2, seed=3))
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[acceptance.pick(sampler, logits, [1], [], None, 4, None)] += 1
    kept = torch.softmax(logits, 0) * (torch.softmax(logits, 0) >= 0.2 * torch.softmax(logits, 0).max())
    assert counts[3] == counts[4] == 0
    assert goodness_of_fit(counts, kept) >= THRESHOLD


# -- the Generator ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid():
    return load_model(TRAINED_HYBRID, device="cpu")


PROMPT = [999, 992, 261, 577, 14, 263, 1089, 606]  # "Once upon a time, the old man"
JOBS, NEW = 1200, 4


def _position_counts(model, drafter, vocab: int, seed: int) -> list[torch.Tensor]:
    """Token counts at each of the ``NEW`` positions over ``JOBS`` seeded jobs at temperature 1."""
    gen = Generator(model, cache_tokens=4096, page_size=16, max_batch_size=48, drafter=drafter)
    jobs = [
        Job(PROMPT, NEW, SamplingSettings(temperature=1.0, seed=seed * 100_000 + i), stop_token_ids=())
        for i in range(JOBS)
    ]
    counts = [torch.zeros(vocab) for _ in range(NEW)]
    for result in gen.generate(jobs):
        for position, token in enumerate(result.token_ids):
            counts[position][token] += 1
    if drafter is not None:
        assert gen.speculation.stats.drafted > 0
    return counts


def _proposal(plain: list[torch.Tensor]) -> torch.Tensor:
    """A proposal far from the target: 90% on the token the target most often writes at the
    drafted positions, the rest spread in the target's proportions there. The wrong rule's bias,
    ``min(p, q)`` counted twice, is then close to doubling that token's probability."""
    counts = plain[1] + plain[2] + plain[3]
    q = 0.1 * counts / counts.sum()
    q[counts.argmax()] += 0.9
    return q


@pytest.fixture(scope="module")
def plain_counts(hybrid) -> list[torch.Tensor]:
    """The reference: the same jobs' token counts without drafting (computed once)."""
    return _position_counts(hybrid, None, hybrid.config.get("vocab_size"), seed=1)


def _homogeneity_p_values(model, plain: list[torch.Tensor], point_mass: bool) -> list[float]:
    drafter = FixedProposalDrafter(_proposal(plain), tokens=2, seed=7)
    if point_mass:  # the same drafts, declared deterministic (as n-gram drafts are)
        drafter = _PointMass(drafter)
    drafted = _position_counts(model, drafter, model.config.get("vocab_size"), seed=2)
    return [homogeneity(a, b) for a, b in zip(plain, drafted)]


class _PointMass:
    def __init__(self, inner) -> None:
        self.inner, self.kind = inner, "point-mass"

    def propose(self, requests):
        from engine.generation.speculative.drafter import Draft

        return [Draft(d.tokens) for d in self.inner.propose(requests)]

    def forget(self, key) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("point_mass", [False, True])
def test_drafting_keeps_the_generators_token_distribution(hybrid, plain_counts, point_mass: bool) -> None:
    # Position 0 comes from the prompt's logits (never drafted); positions 1 to 3 are verified.
    p_values = _homogeneity_p_values(hybrid, plain_counts, point_mass)
    print("p-values per position:", p_values)
    assert min(p_values) >= THRESHOLD, p_values


@pytest.mark.slow
def test_the_generator_check_fails_for_a_wrong_rule(hybrid, plain_counts, wrong_rule) -> None:
    p_values = _homogeneity_p_values(hybrid, plain_counts, point_mass=False)
    print("p-values per position:", p_values)
    assert min(p_values[1:]) < THRESHOLD, p_values
