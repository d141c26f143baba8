"""Whether the target model keeps a drafted token, and what it takes instead.

Greedy jobs: the target's token at each position is the argmax of its processed logits, exactly
as plain decoding picks it; a draft is kept while it equals that token, and the first token that
differs is the target's own. The reply is therefore token for token the plain one.

Sampled jobs, the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023):
with ``p`` the target's distribution at the position (every processor applied: penalties, DRY,
min-p, a constraint's mask, bans ...) and ``q`` the proposal's, keep the drafted token ``d`` with
probability ``min(1, p(d) / q(d))``; otherwise draw from the residual ``max(0, p - q)``
normalised. The token that comes out is distributed exactly as ``p``, whatever ``q`` is. For a
deterministic drafter ``q`` is a point mass on ``d``: keep ``d`` with probability ``p(d)``, else
draw from ``p`` with ``d`` taken out.

``p`` here is the distribution the host draw follows (the integer weights of
``engine.generation.sampling``, normalised), and both uniforms come from the job's own generator:
a seeded job is reproducible, though its tokens differ from the same seed without drafting (the
draws consume the generator differently); its distribution does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.generation.sampling import Sampler, draw_weights


def residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
    """``max(0, p - q)`` (unnormalised; float64), ``q`` None meaning a point mass on ``draft``."""
    if q is None:
        out = p.clone()
        out[draft] = 0.0
        return out
    return (p - q.to(p.dtype)).clamp_(min=0.0)


def accept_or_resample(
    p: torch.Tensor, draft: int, q: torch.Tensor | None, u_accept: float, u_draw: float
) -> int:
    """The token at a position whose target distribution is ``p`` (float64 ``[vocab]``, sums to
    1) and whose draft ``draft`` was proposed from ``q`` (None: a point mass): ``draft`` when
    ``u_accept < p(draft) / q(draft)``, else a draw from the normalised residual with ``u_draw``.
    Both uniforms are in [0, 1)."""
    if accepts(p, draft, q, u_accept):
        return draft
    return resample(p, draft, q, u_draw)


def accepts(p: torch.Tensor, draft: int, q: torch.Tensor | None, u: float) -> bool:
    """Whether uniform ``u`` keeps ``draft``: ``u < p(draft) / q(draft)``."""
    q_d = 1.0 if q is None else float(q[draft])
    return q_d > 0 and u < float(p[draft]) / q_d


def resample(p: torch.Tensor, draft: int, q: torch.Tensor | None, u: float) -> int:
    """The token drawn (uniform ``u``) from the normalised :func:`residual` after a rejection."""
    rest = residual(p, draft, q)
    if float(rest.sum()) <= 0:  # p == q (to rounding): the rejection had probability 0
        rest = p
    return _draw(rest, u)


def _draw(weights: torch.Tensor, u: float) -> int:
    """The token a uniform picks from non-negative float ``weights`` (cumulative search)."""
    cum = weights.double().cumsum(0)
    target = torch.tensor([u * float(cum[-1])], dtype=torch.float64)
    return int(torch.searchsorted(cum, target, right=True)[0].clamp(max=weights.numel() - 1))


def pick(
    sampler: Sampler,
    logits: torch.Tensor,
    context: Sequence[int],
    generated: Sequence[int],
    mask: torch.Tensor | None,
    draft: int,
    q: torch.Tensor | None,
) -> int:
    """The job's token at a drafted position (``logits``: the target's there): greedy jobs take
    what plain decoding takes; sampled ones follow :func:`accept_or_resample`."""
    if sampler.settings.is_greedy:
        return sampler.sample(logits, context, generated, mask)
    weights = sampler.weights(logits, context, generated, mask)
    total = int(weights.sum())
    if total <= 0:  # a dead row (nothing allowed): what the plain draw answers
        return draw_weights(weights, 0.0)
    p = weights.double() / total
    if accepts(p, draft, q, sampler.next_uniform()):
        return draft  # no second uniform: a kept draft costs one, as a plain draw does
    return resample(p, draft, q, sampler.next_uniform())
