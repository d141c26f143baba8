"""Drafting with the target checkpoint's own multi-token-prediction (MTP) layer.

Qwen3.5 / Qwen3-Next (``mtp.*``), DeepSeek-V3 / GLM-4.5 (the layer after the last one) and MiMo
(``model.mtp_layers.*``) carry a layer trained to predict the token after next from the target's
final hidden state and the next token's embedding (``engine.architectures.mtp_names`` has the
maths; ``engine.loading.mtp_builder`` reads it). As a drafter:

- *Fed by the target.* The drafter asks for the target's final hidden states (``wants_hidden``):
  every step hands over those of each sequence's positions (prompt chunks, verify steps), and
  :meth:`MtpDrafter.observe` runs the MTP layer over every position ``p`` whose next token is
  known, writing its own cache (one paged sequence per job), so that its attention sees the whole
  past as in training. The last position's output is kept: it drafts the first token.
- *Chained.* :meth:`MtpDrafter.propose` drafts ``k`` tokens: the first from that kept output,
  each next one by running the layer once more at the next position on the hidden state it just
  handed on and the embedding of the token it just drafted (one batched step per drafted token
  for all jobs).
- *Rolled back like the target.* The entries at positions past the target's kept tokens (those of
  chained steps, and of rejected drafts) are overwritten by the next feed: the drafter keeps how
  far its entries follow the target's tokens (``fed``) and cuts back to the prefix they share.
- *Prefix reuse.* Positions the target skipped (pages reused from an earlier prompt) have no
  hidden states: the drafter's sequence then starts at the first position it was handed (its
  ``origin``), at position 0 of its own cache. Rotary attention depends only on the distance
  between positions, so the shift changes nothing but what the layer sees of the skipped part.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from engine.cache.paged import PagedKVCache
from engine.errors import ContextOverflowError
from engine.generation.speculative.drafter import Draft, Drafter, DraftRequest, Observation, common_prefix
from engine.generation.speculative.proposal import draft_generator, pick
from engine.generation.step import StepItem, text_layout
from engine.loading.mtp_builder import build_mtp_head
from engine.modules.mtp_head import MtpHead


@dataclass(eq=False)
class _Sequence:
    pages: list[int] = field(default_factory=list)
    origin: int = 0  # the target position at the drafter's position 0
    fed: int = 0  # positions origin .. fed - 1 hold entries made from the target's hidden states
    tokens: list[int] = field(default_factory=list)  # the target's tokens 0 .. fed they read
    last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, handed on) at fed - 1
    generator: torch.Generator | None = None


@dataclass
class _Feed:
    """One sequence's rows of an MTP step: positions ``first ..`` of the target, their next
    tokens and the hidden states before them."""

    seq: _Sequence
    first: int
    tokens: list[int]
    hidden: torch.Tensor


class MtpDrafter(Drafter):
    """Drafts from ``model``'s MTP layer (a :class:`~engine.model.LoadedModel`; ``head``: the
    layer, read from its checkpoint when None). ``cache_tokens``, ``max_sequences`` and
    ``page_size`` size the layer's own cache (as the target's: the same jobs run in it)."""

    kind = "mtp"
    wants_hidden = True

    def __init__(
        self,
        model,
        cache_tokens: int | None = None,
        max_sequences: int = 16,
        page_size: int = 64,
        head: MtpHead | None = None,
    ) -> None:
        self.target = model.module
        self.head = head if head is not None else build_mtp_head(model)
        self.vocab_size = model.spec.vocab_size
        tokens = cache_tokens or min(model.spec.max_position_embeddings, 8192)
        pages = max(1, -(-tokens // page_size))
        self.cache = PagedKVCache.for_layers(
            [self.head.state], pages, page_size, model.dtype, model.device, max_sequences=max_sequences
        )
        self.cache.pages.reuse_prefixes = False  # one sequence per job, nothing to share
        self._seqs: dict[Hashable, _Sequence] = {}

    # -- fed by the target --------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, seen: Sequence[Observation]) -> None:
        feeds = [feed for obs in seen if (feed := self._feed(obs)) is not None]
        if not feeds:
            return
        normed, handed = self._step([(f.seq, f.first, f.tokens) for f in feeds], [f.hidden for f in feeds])
        for f, x, g in zip(feeds, normed, handed):
            f.seq.last = (self.head.logits(x[-1:])[0], g[-1])

    def _feed(self, obs: Observation) -> _Feed | None:
        """What ``obs`` adds to its sequence's entries (None: nothing), its state brought up to
        date: cut back to the target's tokens, restarted where positions are missing."""
        seq = self._seqs.setdefault(obs.key, _Sequence())
        tokens = obs.tokens
        common = common_prefix(seq.tokens, tokens)
        if seq.fed > common - 1:  # entry p reads token p + 1: it must still be the target's
            seq.fed, seq.last = max(common - 1, 0), None
            del seq.tokens[seq.fed + 1 :]
        valid = 0  # rows whose input is still the sequence's token there (kept, not rejected)
        while (
            valid < len(obs.inputs)
            and obs.start + valid < len(tokens)
            and tokens[obs.start + valid] == obs.inputs[valid]
        ):
            valid += 1
        end = min(obs.start + valid, len(tokens) - 1)  # feed positions .. end - 1 (next token known)
        if seq.fed <= seq.origin or obs.start > seq.fed:  # nothing kept, or a gap: start here
            seq.origin = seq.fed = obs.start
            seq.last = None
        first = seq.fed
        if first >= end:
            return None
        if not self._reserve(obs.key, seq, end - seq.origin):
            return None
        seq.fed = end
        seq.tokens = list(tokens[: end + 1])
        hidden = obs.hidden[first - obs.start : end - obs.start]
        return _Feed(seq, first, list(tokens[first + 1 : end + 1]), hidden)

    # -- drafting -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        live: list[tuple[int, DraftRequest, _Sequence]] = []
        for i, request in enumerate(requests):
            seq = self._seqs.get(request.key)
            n = len(request.tokens)
            if seq is None or seq.last is None or seq.fed != n - 1 or seq.tokens != list(request.tokens):
                continue  # not fed up to the last token (a reused prefix's first step, a full cache)
            if not self._reserve(request.key, seq, n - 2 + request.max_tokens - seq.origin):
                continue
            if request.temperature > 0 and seq.generator is None:
                seq.generator = draft_generator(request)
            live.append((i, request, seq))
        tokens: dict[int, list[int]] = {i: [] for i, _, _ in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in live}
        handed: dict[int, torch.Tensor] = {}
        for i, request, seq in live:
            logits, handed[i] = seq.last
            self._pick(request, seq, logits, tokens[i], probs[i])
        for step in range(1, max((r.max_tokens for _, r, _ in live), default=0)):
            going = [(i, r, s) for i, r, s in live if len(tokens[i]) < r.max_tokens]
            if not going:
                break
            # Position n - 2 + step: the last drafted token's embedding, the hidden state handed on.
            rows = [(s, len(r.tokens) - 2 + step, [tokens[i][-1]]) for i, r, s in going]
            normed, out = self._step(rows, [handed[i][None] for i, _, _ in going])
            for (i, request, seq), x, g in zip(going, normed, out):
                handed[i] = g[-1]
                self._pick(request, seq, self.head.logits(x[-1:])[0], tokens[i], probs[i])
        for i, request, _ in live:
            sampled = request.temperature > 0
            drafts[i] = Draft(tokens[i], torch.stack(probs[i]) if sampled else None)
        return drafts

    def _pick(
        self, request: DraftRequest, seq: _Sequence, logits: torch.Tensor, tokens: list, probs: list
    ) -> None:
        token, q = pick(logits, request.temperature, self.vocab_size, seq.generator)
        tokens.append(token)
        if q is not None:
            probs.append(q)

    def forget(self, key: Hashable) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.cache.pages.release(seq.pages)

    # -- the MTP layer over its cache ---------------------------------------------------------

    def _step(
        self, rows: list[tuple[_Sequence, int, list[int]]], hidden: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One batched step of the MTP layer: per ``(sequence, first target position, next
        tokens)`` its rows' ``(normed, handed on)`` outputs; ``hidden``: the hidden states
        before those tokens, one ``[len(tokens), hidden]`` per sequence."""
        items = [StepItem(next_tokens, first - seq.origin, seq.pages) for seq, first, next_tokens in rows]
        batch = text_layout(items, self.cache, self.target.device)
        ids = torch.tensor([t for _, _, next_tokens in rows for t in next_tokens], device=self.target.device)
        embeds = self.target.embed(ids)
        states = torch.cat(hidden).to(embeds.dtype)
        normed, handed = self.head(embeds, states, batch, self.cache.layer(0))
        bounds = [(s.start, s.start + s.length) for s in batch.sequences]
        return [normed[a:b] for a, b in bounds], [handed[a:b] for a, b in bounds]

    def _reserve(self, key: Hashable, seq: _Sequence, positions: int) -> bool:
        """Pages for the sequence's first ``positions`` positions; False (and the sequence
        dropped) where the drafter's cache has no room left."""
        needed = -(-max(positions, 1) // self.cache.page_size)
        if needed > len(seq.pages):
            try:
                seq.pages += self.cache.pages.allocate(needed - len(seq.pages))
            except ContextOverflowError:
                self.forget(key)
                return False
        return True
