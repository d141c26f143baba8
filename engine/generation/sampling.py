"""Turning next-token logits into a token: penalties, temperature, truncation, a seeded draw.

The order follows common practice (and Hugging Face's): penalties on the raw logits, then
temperature, then top-k, top-p and min-p truncation, then sampling. Temperature 0 is greedy.

:func:`truncate` is the plain definition of the truncation rules (a mask over the whole
vocabulary). The sampler takes the same decision with :func:`kept_tokens`, which never sorts or
draws over the whole vocabulary (a 128k-token sort costs ~13 ms on a laptop core, a multinomial
draw ~3 ms, a decode step of an 8B model ~5 ms on the GPU): min-p is a threshold on the logits,
top-p grows a top-k window until it holds the cutoff, and the draw is one uniform number through
the kept tokens' cumulative probabilities, in ascending id order (the order the GPU sampler,
``ext/sampling.cu``, and its torch reference, :mod:`engine.generation.device_sampling`, use too:
the same uniform gives the same token on all three, up to float rounding at a boundary).

Ties (equal logits at a boundary) are kept or dropped together: top-k keeps every token equal to
the k-th largest, and top-p's "tokens ranked strictly before" are those of strictly greater
logit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.errors import SamplingSettingError


@dataclass
class SamplingSettings:
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # >1 discourages every token already in the context
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None

    @classmethod
    def greedy(cls) -> SamplingSettings:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no penalty: the token is the argmax of the raw logits, wherever they are."""
        return (
            self.is_greedy
            and self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
        )

    def validate(self) -> None:
        """Raise :class:`~engine.errors.SamplingSettingError` naming the first field outside its
        range. The one check of these values: the Sampler runs it for every job, and entry points
        (the CLI, the app's worker, a server) call it to refuse bad values before any model work.
        NaN passes every ordered comparison's negation, so finiteness is checked explicitly."""
        _check_real("temperature", self.temperature, "a finite number >= 0 (0 = greedy)", lambda v: v >= 0)
        _check_int("top_k", self.top_k, "a whole number >= 0 (0 = off)", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "a number in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        _check_real("min_p", self.min_p, "a number in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        _check_real(
            "repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)", lambda v: v > 0
        )
        _check_real("presence_penalty", self.presence_penalty, "a finite number (0 = off)", lambda v: True)
        _check_real("frequency_penalty", self.frequency_penalty, "a finite number (0 = off)", lambda v: True)
        if self.seed is not None:
            # torch's generator takes 64-bit seeds; a negative one is refused rather than
            # wrapped, since elsewhere (llama.cpp) -1 means "random".
            _check_int("seed", self.seed, "a whole number in [0, 2**64)", lambda v: 0 <= v < 2**64)


def _check_real(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not ok(float(value))
    ):
        raise SamplingSettingError(name, allowed, value)


def _check_int(name: str, value: object, allowed: str, ok: Callable[[int], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(int(value)):
        raise SamplingSettingError(name, allowed, value)


def apply_penalties(
    logits: torch.Tensor,
    s: SamplingSettings,
    context: Sequence[int],
    generated: Sequence[int],
    context_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition penalty over the whole context (CTRL-style: divide positive logits, multiply
    negative ones); presence and frequency penalties over generated tokens (OpenAI-style).
    ``context_ids``: the context's distinct ids, when the caller keeps them (any order)."""
    if s.repetition_penalty != 1.0 and len(context):
        if context_ids is None:
            context_ids = torch.as_tensor(sorted(set(context)), dtype=torch.long)
        ids = context_ids.to(logits.device)
        picked = logits[ids]
        logits[ids] = torch.where(picked > 0, picked / s.repetition_penalty, picked * s.repetition_penalty)
    if (s.presence_penalty or s.frequency_penalty) and len(generated):
        ids, counts = torch.as_tensor(list(generated), device=logits.device).unique(return_counts=True)
        logits[ids] -= s.presence_penalty + s.frequency_penalty * counts.to(logits.dtype)
    return logits


def truncate(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """Mask (to -inf) every token top-k, top-p or min-p rules out; the best token always stays."""
    if s.top_k > 0 and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0 or s.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        if s.min_p > 0.0:
            logits = logits.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
        if s.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep a token if the mass of the tokens strictly before it is below top_p.
            before = _before_ties(sorted_probs, logits[order])
            drop = torch.zeros_like(probs, dtype=torch.bool)
            drop[order] = before >= s.top_p
            logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _before_ties(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """For probabilities ``p`` of the logits ``x`` sorted in descending order, the mass of the
    tokens of strictly greater logit than each (tokens of equal logit share the mass before the
    first of them: ties stay or go together)."""
    before = p.cumsum(-1) - p
    first = torch.searchsorted(-x, -x, side="left")  # first index of each tie group
    return before[first]


def _top_p_keep(x: torch.Tensor, top_p: float, lse: torch.Tensor) -> torch.Tensor:
    """Bool mask over ``x``: the tokens top-p keeps (``truncate``'s rule: a token stays when the
    probability mass of the tokens ranked before it is below ``top_p``), probabilities being
    ``exp(x - lse)``. Only a top-k window that contains the cutoff is sorted: it starts at 64
    tokens and grows 8x until its last token is dropped (every token outside it, of a logit no
    greater, is then dropped too, ties included), at worst to the whole vector."""
    n = x.numel()
    k = min(n, 64)
    while True:
        top, order = torch.topk(x, k)
        p = torch.exp(top - lse)
        before = _before_ties(p, top)
        if k == n or float(before[-1]) >= top_p:
            keep = torch.zeros(n, dtype=torch.bool)
            keep[order[before < top_p]] = True
            return keep
        k = min(n, k * 8)


def kept_tokens(x: torch.Tensor, s: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids, logits)`` of the tokens :func:`truncate` keeps for the temperature-scaled
    logits ``x`` (1-D, CPU), ids in ascending order, found without a full sort (see the module
    docstring)."""
    ids = None  # None: x is the whole vocabulary, ids are positions
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        ids = (x >= kth).nonzero().squeeze(1)  # every token tied with the k-th stays
        x = x[ids]
    # Top-p's probabilities are over every token top-k left, min-p's cut included.
    lse = torch.logsumexp(x, 0) if s.top_p < 1.0 else None

    def select(keep: torch.Tensor) -> None:
        nonlocal x, ids
        chosen = keep.nonzero().squeeze(1)
        x, ids = x[chosen], (chosen if ids is None else ids[chosen])

    if s.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p): no softmax needed.
        select(x >= x.max() + math.log(s.min_p))
    if s.top_p < 1.0:
        # Every token ranked before a min-p survivor survives too, so the mass before it is the
        # same among the survivors: top-p may run on what min-p left.
        select(_top_p_keep(x, s.top_p, lse))
    return (torch.arange(x.numel()) if ids is None else ids), x


class Sampler:
    """Sampling state of one job: its settings and its own random generator."""

    def __init__(self, settings: SamplingSettings) -> None:
        settings.validate()
        self.settings = settings
        self.generator = torch.Generator()
        seed = settings.seed if settings.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self.generator.manual_seed(seed)
        # The context's distinct ids, grown as the job's tokens are appended (the repetition
        # penalty needs them every token; rebuilding the set costs ~0.4 ms per 1,000 tokens).
        self._seen: set[int] = set()
        self._seen_ids = torch.empty(0, dtype=torch.long)
        self._seen_len = 0

    def context_ids(self, context: Sequence[int]) -> torch.Tensor:
        """The distinct ids of ``context`` (what the repetition penalty divides), kept up to date
        as the context grows: the host draw and the device one (``pack_rows``) both use them."""
        if len(context) < self._seen_len:  # not the context seen so far: start over
            self._seen, self._seen_ids, self._seen_len = set(), torch.empty(0, dtype=torch.long), 0
        fresh = [t for t in dict.fromkeys(context[self._seen_len :]) if t not in self._seen]
        if fresh:
            self._seen.update(fresh)
            self._seen_ids = torch.cat([self._seen_ids, torch.tensor(fresh, dtype=torch.long)])
        self._seen_len = len(context)
        return self._seen_ids

    def sample(
        self,
        logits: torch.Tensor,
        context: Sequence[int],
        generated: Sequence[int],
        mask: torch.Tensor | None = None,
        u: float | None = None,
    ) -> int:
        """One token id from the float32 ``[vocab]`` ``logits``; ``mask`` (bool ``[vocab]``, True =
        allowed, at least one True) restricts the choice, e.g. to what a constraint permits. It
        applies before truncation, so top-k/top-p/min-p choose among the allowed tokens. ``u``:
        the draw's uniform in [0, 1) (default: :meth:`next_uniform`; greedy draws none)."""
        s = self.settings
        ids = self.context_ids(context) if s.repetition_penalty != 1.0 else None
        logits = apply_penalties(logits.float().cpu().clone(), s, context, generated, ids)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        if s.is_greedy:
            return int(torch.argmax(logits))
        ids, x = kept_tokens(logits / s.temperature, s)
        # Inverse CDF over the kept tokens in ascending id order: the first whose cumulative
        # probability exceeds u (a token of probability 0 is never chosen: its interval is empty).
        cdf = torch.softmax(x, dim=-1).cumsum(0)
        if u is None:
            u = self.next_uniform()
        target = torch.tensor([u], dtype=torch.float32) * cdf[-1]
        i = min(int(torch.searchsorted(cdf, target, right=True)), ids.numel() - 1)
        return int(ids[i])

    def next_uniform(self) -> float:
        """The next uniform in [0, 1) of the job's generator (a float32 value): what a draw uses,
        here or on the device (the same stream of numbers either way)."""
        return float(torch.rand(1, generator=self.generator))
