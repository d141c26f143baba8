"""DRY ("don't repeat yourself"): penalise a token that would extend a repeat of earlier text.

For the last token of the context, every earlier occurrence of it starts a match that runs
backwards while the tokens before it equal the tokens before the context's end; the token that
followed that occurrence would extend a repeat of that many tokens. A candidate whose longest
such repeat ``n`` is at least ``allowed_length`` loses ``multiplier * base ** (n - allowed)``
from its logit. Sequence breakers (tokens whose text holds one of the breaker strings: newlines,
colons, quotes by default) end every match, so a repeated name or line prefix is not punished
across them.

This is the published definition (the DRY pull request to text-generation-webui, since adopted
by llama.cpp and koboldcpp), written here in numpy: matches are found by scanning for the last
token, so a step costs O(context) plus the match lengths.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.generation.sampling import SamplingBatch

# base ** (n - allowed) overflows float32 past ~150 for base 1.75; a repeat this long already
# costs more than any logit gap, so longer matches count as this long.
MAX_MATCH = 64


def dry_penalties(
    context: Sequence[int],
    multiplier: float,
    base: float,
    allowed_length: int,
    breakers: Collection[int] = (),
) -> dict[int, float]:
    """``{token id: amount to subtract from its logit}`` for the next token after ``context``."""
    if multiplier <= 0 or len(context) < 2:
        return {}
    ctx = np.asarray(context, dtype=np.int64)
    last = int(ctx[-1])
    if last in breakers:
        return {}
    starts = np.flatnonzero(ctx[:-1] == last)
    longest: dict[int, int] = {}
    end = len(ctx) - 1
    for i in starts.tolist():
        n = 1  # the occurrence of the last token itself
        while n < MAX_MATCH and i - n >= 0 and ctx[i - n] == ctx[end - n] and int(ctx[i - n]) not in breakers:
            n += 1
        follower = int(ctx[i + 1])
        if n > longest.get(follower, 0):
            longest[follower] = n
    return {
        token: multiplier * base ** (n - allowed_length)
        for token, n in longest.items()
        if n >= allowed_length
    }


def apply(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Subtract each row's DRY penalties (rows whose multiplier is 0 are left as they are)."""
    vocab = x.shape[1]
    for r, s in enumerate(b.settings or ()):
        if s.dry_multiplier <= 0 or b.host is None:
            continue
        host = b.host[r]
        amounts = dry_penalties(
            host.context, s.dry_multiplier, s.dry_base, s.dry_allowed_length, host.breakers
        )
        amounts = {t: a for t, a in amounts.items() if 0 <= t < vocab}
        if amounts:
            ids = torch.tensor(list(amounts), dtype=torch.long, device=x.device)
            x[r, ids] -= torch.tensor(list(amounts.values()), dtype=x.dtype, device=x.device)
    return x


@lru_cache(maxsize=8)
def _breaker_ids(texts: tuple[str, ...], breakers: tuple[str, ...]) -> frozenset[int]:
    return frozenset(i for i, text in enumerate(texts) if text and any(b in text for b in breakers))


def breaker_ids(tokenizer, breakers: Sequence[str]) -> frozenset[int]:
    """The ids of ``tokenizer`` whose text contains any of ``breakers`` (decoded one by one, once
    per tokenizer and breaker list: a few hundred ms at a 150k vocabulary)."""
    if tokenizer is None or not breakers:
        return frozenset()
    texts = _token_texts(tokenizer)
    return _breaker_ids(texts, tuple(breakers))


_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_texts(tokenizer) -> tuple[str, ...]:
    """Each id's text as decoded alone, kept as long as the tokenizer lives."""
    texts = _texts.get(tokenizer)
    if texts is None:
        size = getattr(tokenizer, "vocab_size", None) or 0
        texts = _texts[tokenizer] = tuple(tokenizer.decode([i]) for i in range(size))
    return texts
