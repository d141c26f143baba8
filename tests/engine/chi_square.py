"""Chi-square tests for the sampling tests: goodness of fit and two-sample homogeneity.

p-values come from the chi-square survival function, the regularised upper incomplete gamma
function ``Q(df / 2, stat / 2)`` (``torch.special.gammaincc``): no scipy needed. Bins with small
expected counts are pooled into one, so that the chi-square approximation holds (at least 5
expected in every bin).
"""

from __future__ import annotations

import torch


def _p_value(stat: float, df: int) -> float:
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of ``counts`` (one per token) drawn from ``probs``."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = counts.sum() * probs
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    if float(obs[~keep].sum()) > 0:  # a count where nothing was expected: impossible outcome
        return 0.0
    return _p_value(stat, int(keep.sum()) - 1)


def homogeneity(a: torch.Tensor, b: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of two count vectors (one per token) coming from one distribution."""
    a, b = a.double(), b.double()
    total = a + b
    na, nb = float(a.sum()), float(b.sum())
    share = total / (na + nb)
    big = (share * min(na, nb)) >= min_expected
    rows = [torch.cat([x[big], x[~big].sum()[None]]) for x in (a, b)]
    pooled = rows[0] + rows[1]
    keep = pooled > 0
    stat = 0.0
    for x, n in zip(rows, (na, nb)):
        expected = pooled[keep] * n / (na + nb)
        stat += float(((x[keep] - expected) ** 2 / expected).sum())
    return _p_value(stat, int(keep.sum()) - 1)
