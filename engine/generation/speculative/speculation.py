"""Speculative decoding inside the Generator's steps: draft, verify, accept, roll back.

Each step, every decoding job that can take a draft asks the drafter for up to ``k`` tokens
(:meth:`Speculation.propose`); its step item then feeds its last token *and* the draft, ``1 + k``
tokens, and asks for logits at all of them (a *verify* item). Jobs with and without drafts, and
prompts being prefilled, share the step as always: a verify item is just a short chunk whose
logits are all wanted. :meth:`Speculation.land` then walks the positions in order, each one
sampled from the target's logits there with every processor of the job (penalties, DRY, a
constraint's mask, stop strings: ``Generator._advance``, as for any token), and keeps drafted
tokens while the acceptance rule keeps them (``engine.generation.speculative.acceptance``); the
first token that replaces a draft, or the one after a fully kept draft, is the target's own, so a
verify step always yields at least one token.

Rolling back what was rejected:

- KV pages: the job's cached length (``in_cache``) stops after its last kept token; the rejected
  positions' keys and values stay in the job's pages, are ignored by attention (it reads only
  ``in_cache`` positions) and are overwritten by the next step. The pages themselves stay with
  the job: the generator reserves a job's pages up to its length limit when it is admitted, so
  there is nothing to free (freeing them would let another job take pages this one will need).
  A page is named for prefix reuse only once kept tokens fill it, never with rejected content.
- Recurrent layers (hybrid models): their state after the step has absorbed every drafted token,
  and unlike pages it cannot drop positions. We keep one copy of the state from before the step
  (:class:`~engine.generation.state_checkpoint.StateCheckpoint`) and, when a draft is partly
  rejected, restore it and let the next step feed the kept tokens again (in the same item as the
  next token, no step of its own). The alternative - the state after every drafted position -
  would need every recurrent mixer (gated delta net, Mamba-2, short convolution, and each future
  kind) to emit per-token states, ``k`` copies of a state that can be megabytes per layer; the
  re-run costs a few rows of the next step instead, and no mixer knows about drafting. A re-run
  item carries no draft of its own (so a job's state always moves forward), and a verify item of
  a model with recurrent layers never crosses a page boundary, so the state at the end of each
  page can still be kept for prefix reuse.

Shapes: a verify item has ``1 + k`` tokens and ``k`` is one of ``1..max_tokens``, so a GPU verify
step can be captured per ``(batch, k)`` with drafts padded to the batch's ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.cache.paged import PagedKVCache
from engine.generation.job import JobResult
from engine.generation.sampling import active_processors
from engine.generation.speculative.draft_length import EXTRA_TOKEN_COST, DraftLength
from engine.generation.speculative.drafter import Draft, Drafter, DraftRequest, Observation
from engine.generation.state_checkpoint import StateCheckpoint, recurrent_layers

MAX_DRAFT_TOKENS = 8


@dataclass
class SpeculationStats:
    """Totals over a generator's verify steps (one step of one job counts once)."""

    verify_steps: int = 0  # job-steps that carried a draft
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of them kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify step yielded on average (kept drafts plus the target's own)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class Speculation:
    """Drafting for one Generator: ``drafter`` proposes, at most ``max_tokens`` per step."""

    def __init__(
        self,
        drafter: Drafter,
        max_tokens: int,
        cache: PagedKVCache,
        extra_token_cost: float = EXTRA_TOKEN_COST,
    ) -> None:
        if not 1 <= max_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft tokens must be in 1..{MAX_DRAFT_TOKENS}, got {max_tokens}")
        self.drafter, self.max_tokens = drafter, max_tokens
        self.cache = cache
        self.extra_token_cost = extra_token_cost
        self._recurrent = recurrent_layers(cache)
        self._lengths: dict[object, DraftLength] = {}
        self._checkpoints: dict[object, StateCheckpoint] = {}
        self.stats = SpeculationStats()

    # -- before the step ----------------------------------------------------------------------

    def propose(self, runs: list) -> dict[object, Draft]:
        """Drafts for the decoding ``runs`` that take one this step (only non-empty ones)."""
        requests = []
        for run in runs:
            k = self._room(run)
            if k > 0:
                sampling = run.sampler.settings
                temperature = 0.0 if sampling.is_greedy else sampling.temperature
                requests.append(DraftRequest(run, run.tokens, k, temperature, sampling.seed))
        if not requests:
            return {}
        drafts = {}
        for request, draft in zip(requests, self.drafter.propose(requests)):
            if len(draft) > request.max_tokens:
                draft = Draft(
                    draft.tokens[: request.max_tokens],
                    None if draft.q is None else draft.q[: request.max_tokens],
                )
            if draft.tokens:
                run = request.key
                drafts[run] = draft
                if self._recurrent:
                    self._checkpoints[run] = StateCheckpoint(self._recurrent, run.state_slot, run.in_cache)
        return drafts

    def _room(self, run) -> int:
        """How many tokens ``run`` may draft this step (0: none)."""
        if len(run.tokens) - run.in_cache != 1:
            return 0  # it re-runs kept tokens after a rejection (recurrent state): no draft on top
        length = self._lengths.get(run)
        if length is None:
            length = self._lengths[run] = DraftLength(self.max_tokens, self.extra_token_cost)
        k = min(length.tokens, run.limit - len(run.tokens) - 1)
        if self._recurrent and self.cache.snapshots is not None and self.cache.pages.reuse_prefixes:
            ps = self.cache.page_size
            k = min(k, (run.in_cache // ps + 1) * ps - run.in_cache - 1)  # end on or before the page end
        return max(0, k)

    # -- after the step -----------------------------------------------------------------------

    def land(self, gen, run, item, rows: torch.Tensor, draft: Draft) -> JobResult:
        """Accept what the acceptance rule keeps of ``run``'s verify ``item`` (logit ``rows``: one
        per position from its last pending token on), report the tokens as one result and leave
        the job's cache where its kept tokens end."""
        start = item.past
        checkpoint = self._checkpoints.pop(run, None)
        settings = run.sampler.settings
        argmaxes = None
        if not active_processors(settings, run.constraint is not None):
            argmaxes = rows.argmax(dim=-1).tolist()  # plain greedy: the argmax, as plain decoding
        run.in_cache = start + len(item.tokens) - len(draft)  # its pending tokens are in the cache
        gen._register_full_pages(run)
        results, accepted, rewound = [], 0, False
        for i in range(len(draft) + 1):
            guess = draft.tokens[i] if i < len(draft) else None
            before = len(run.tokens)
            if argmaxes is not None:
                result = gen._advance(run, None, argmaxes[i])
            else:
                spec = None if guess is None else (guess, draft.proposal(i))
                result = gen._advance(run, rows[i], None, spec)
            results.append(result)
            rewound = len(run.tokens) != before + 1  # a banned string took the reply back
            if rewound or guess is None or run.tokens[-1] != guess:
                break
            if result.done:  # the guess was right, and the job ends with it (EOS, a limit)
                accepted += 1
                break
            accepted += 1
            run.in_cache += 1  # the kept draft's position is in the cache
            gen._register_full_pages(run)
        self._record(run, len(draft), accepted)
        if run in gen._active and not rewound:
            if checkpoint is not None and accepted < len(draft):
                checkpoint.restore(run.state_slot)  # the state saw rejected tokens: go back
                run.in_cache = checkpoint.position
            elif self._recurrent:
                self._keep_page_snapshot(gen, run, start)
        return _merged(results)

    def _keep_page_snapshot(self, gen, run, start: int) -> None:
        """Where the step ended a page of the reply, keep the recurrent state for prefix reuse
        (as a plain decode step that fills a page does)."""
        ps = self.cache.page_size
        end = run.in_cache
        if (
            self.cache.snapshots is not None
            and self.cache.pages.reuse_prefixes
            and end > start
            and end % ps == 0
            and end - 1 >= run.prompt_len
            and len(run.keys) * ps == end  # the page is named (not held back by a banned string)
        ):
            gen._keep_decode_snapshot(run, run.keys[-1])

    def _record(self, run, drafted: int, accepted: int) -> None:
        self.stats.verify_steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        length = self._lengths.get(run)
        if length is not None:
            length.update(drafted, accepted)

    # -- a drafter that reads the target's hidden states --------------------------------------

    @property
    def wants_hidden(self) -> bool:
        """Whether the target's steps must return their final hidden states (an MTP drafter)."""
        return getattr(self.drafter, "wants_hidden", False)  # a drafter may only duck-type one

    def observe(self, gen, runs: list, items: list, hidden: list[torch.Tensor]) -> None:
        """After a step (its tokens accepted and reported): hand the drafter each still active
        job's hidden states of the step's positions, with the tokens it holds now."""
        seen = [
            Observation(run, run.tokens, item.past, item.tokens, rows)
            for run, item, rows in zip(runs, items, hidden)
            if run in gen._active
        ]
        if seen:
            self.drafter.observe(seen)

    def forget(self, run) -> None:
        """``run`` finished: drop its drafter state, draft length and checkpoint."""
        self._lengths.pop(run, None)
        self._checkpoints.pop(run, None)
        self.drafter.forget(run)


def _merged(results: list[JobResult]) -> JobResult:
    """One result for a job's tokens of one step: texts and ids joined, the rest the last one's."""
    if len(results) == 1:
        return results[0]
    text = "".join(r.text for r in results)
    ids = [t for r in results for t in r.token_ids]
    return replace(results[-1], text=text, token_ids=ids)
