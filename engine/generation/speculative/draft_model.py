"""Drafting with a smaller model that shares the target's tokenizer.

The draft model keeps its own paged cache (and recurrent-state slots, where it has recurrent
layers) with one sequence per target job. Each proposal first brings that sequence up to the
target's tokens (what the target kept since last time: usually the last kept draft tokens and the
target's own token), then runs ``k - 1`` one-token steps of its own; every job's sequence moves
in the same batched steps. Where the target rejected part of the last draft, the draft sequence
is cut back to the longest prefix it shares with the target's tokens: KV pages by length, a
recurrent state from the copy taken when the last proposal started (always within that prefix).

Greedy jobs get greedy drafts (a point mass each); sampled jobs get drafts drawn from the draft
model's softmax at the job's temperature, with those distributions as ``q``, which the
acceptance rule needs to stay exact.

On a GPU the draft model's steps replay from CUDA graphs of its own
(``engine.generation.cuda_graph``), as the target's do: a draft model is small, so launching its
kernels one by one from Python would cost several times what running them does. The one-token
steps are decode rows; a catch-up of a few tokens (the kept drafts and the target's token) takes
one row per token, as a verify step does, and only its last row's logits are used. Prompts, and
models whose recurrent state must absorb tokens one after another, run eagerly. Greedy drafts
chain on the device: each step's input is the previous step's argmax, and the host reads the
drafted tokens once a proposal, not once a token.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.cache.paged import PagedKVCache
from engine.errors import ContextOverflowError
from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.speculative.drafter import Draft, Drafter, DraftRequest, common_prefix
from engine.generation.speculative.proposal import draft_generator, pick
from engine.generation.speculative.speculation import MAX_DRAFT_TOKENS
from engine.generation.state_checkpoint import StateCheckpoint, recurrent_layers
from engine.generation.step import StepItem, run_step
from engine.model import LoadedModel


@dataclass(eq=False)
class _Sequence:
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    fed: list[int] = field(default_factory=list)  # tokens whose positions are in the draft cache
    checkpoint: StateCheckpoint | None = None
    generator: torch.Generator | None = None


class ModelDrafter(Drafter):
    """Drafts from ``model`` (a :class:`LoadedModel` with the target's tokenizer). ``vocab_size``:
    the width of the target's logits (a proposal distribution is given over it); ``cache_tokens``
    and ``max_sequences``: the draft cache's size (as the target's: the same jobs run in it).
    ``cuda_graphs``: replay the draft model's steps from CUDA graphs where they fit (a CUDA model)."""

    kind = "model"

    def __init__(
        self,
        model: LoadedModel,
        vocab_size: int,
        cache_tokens: int,
        max_sequences: int = 16,
        page_size: int = 64,
        max_chunk_tokens: int = 512,
        cuda_graphs: bool = True,
    ) -> None:
        self.model, self.vocab_size = model, vocab_size
        self.cache = PagedKVCache.for_model(
            model.spec, cache_tokens, page_size, model.dtype, model.device, max_sequences=max_sequences
        )
        self.cache.pages.reuse_prefixes = False  # one draft sequence per job, nothing to share
        self.max_chunk_tokens = max_chunk_tokens
        self._recurrent = recurrent_layers(self.cache)
        self._seqs: dict[Hashable, _Sequence] = {}
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and model.device.type == "cuda":
            # A step holds up to max_sequences jobs' rows; a catch-up item up to 1 + the most
            # drafted tokens rows.
            rows = min(64, max_sequences * (1 + MAX_DRAFT_TOKENS))
            self.graphs = DecodeGraphs(model.module, self.cache, max_batch=rows)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        live: list[tuple[int, DraftRequest, _Sequence]] = []
        for i, request in enumerate(requests):
            seq = self._prepare(request)
            if seq is not None:
                live.append((i, request, seq))
        drafts = [Draft([]) for _ in requests]
        if not live:
            return drafts
        tokens: dict[int, list[int]] = {i: [] for i, _, _ in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in live}
        logits = self._catch_up([(request, seq) for _, request, seq in live])
        if not self._greedy_chain(live, logits, tokens):
            for (i, request, seq), row in zip(live, logits):
                self._choose(request, seq, row, tokens[i], probs[i])
        for _ in range(max(r.max_tokens for _, r, _ in live) - 1):
            going = [(i, r, s) for i, r, s in live if len(tokens[i]) < r.max_tokens]
            if not going:
                break
            items = [
                StepItem([tokens[i][-1]], len(s.fed), s.pages, "last", state_slot=s.slot) for i, _, s in going
            ]
            rows = self._step(items)
            for (i, request, seq), row in zip(going, rows):
                seq.fed.append(tokens[i][-1])
                self._choose(request, seq, row[-1], tokens[i], probs[i])
        for i, request, _ in live:
            sampled = request.temperature > 0
            drafts[i] = Draft(tokens[i], torch.stack(probs[i]) if sampled else None)
        return drafts

    def forget(self, key: Hashable) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.cache.pages.release(seq.pages)
            self.cache.state_slots.release(seq.slot)

    # -- one sequence ---------------------------------------------------------------------------

    def _prepare(self, request: DraftRequest) -> _Sequence | None:
        """The request's draft sequence, cut back to what it shares with the target's tokens and
        with pages for what this proposal adds; None where the draft cache is full (no draft)."""
        seq = self._seqs.get(request.key)
        if seq is None:
            try:
                slot = self.cache.state_slots.allocate()
            except ContextOverflowError:
                return None
            seq = self._seqs[request.key] = _Sequence(slot=slot, generator=draft_generator(request))
        target = request.tokens
        common = common_prefix(seq.fed, target[:-1])  # the target's last token is always fed again
        if common < len(seq.fed):
            if self._recurrent:
                point = seq.checkpoint
                if point is not None and point.position <= common:
                    point.restore(seq.slot)
                    common = point.position
                else:
                    common = 0  # no copy that early: the state starts again from zeros
            del seq.fed[common:]
        ps = self.cache.page_size
        needed = -(-(len(target) + request.max_tokens) // ps)
        if needed > len(seq.pages):
            if needed - len(seq.pages) > self.cache.pages.available:
                self.forget(request.key)
                return None
            seq.pages += self.cache.pages.allocate(needed - len(seq.pages))
        return seq

    def _catch_up(self, work: list[tuple[DraftRequest, _Sequence]]) -> list[torch.Tensor]:
        """Feed each sequence the target's tokens it lacks (long ones in chunks); each one's
        logits after the target's last token. Recurrent models keep a copy of the state there."""
        while True:
            long = [(r, s) for r, s in work if len(r.tokens) - len(s.fed) > self.max_chunk_tokens]
            if not long:
                break
            items = []
            for request, seq in long:
                chunk = list(request.tokens[len(seq.fed) : len(seq.fed) + self.max_chunk_tokens])
                items.append(StepItem(chunk, len(seq.fed), seq.pages, None, state_slot=seq.slot))
                seq.fed += chunk
            self._step(items)
        items = []
        for request, seq in work:
            rest = list(request.tokens[len(seq.fed) :])
            items.append(StepItem(rest, len(seq.fed), seq.pages, "last", state_slot=seq.slot))
            seq.fed += rest
        rows = self._step(items)
        if self._recurrent:
            for _, seq in work:
                seq.checkpoint = StateCheckpoint(self._recurrent, seq.slot, len(seq.fed))
        return [row[-1] for row in rows]

    def _step(self, items: list[StepItem]) -> list[torch.Tensor]:
        """One step of the draft model: each item's logits rows, the last one being the logits
        after its last token. From a CUDA graph where the step fits one (a multi-token item as a
        verify item: a row per token), else eagerly."""
        if self.graphs is not None:  # run() declines what is neither a decode nor a verify item
            rows = [
                replace(it, logits=len(it.tokens)) if len(it.tokens) > 1 and it.logits == "last" else it
                for it in items
            ]
            logits = self.graphs.run(rows)
            if logits is not None:
                return logits
        return run_step(self.model.module, self.cache, items)

    def _greedy_chain(
        self, live: list[tuple[int, DraftRequest, _Sequence]], logits: list[torch.Tensor], tokens: dict
    ) -> bool:
        """Greedy drafts for every live request, chained on the device: each graph-replayed step
        takes the previous step's argmax as its input, so the host queues all the steps and reads
        the drafted tokens once, instead of waiting for each token before it can launch the next
        step. Runs as many steps as the shortest draft allows (the per-token loop after it drafts
        the rest); False, drafting nothing, where the requests are not all greedy, the steps do
        not replay from graphs, or the draft model's logits are wider than the target's vocabulary
        (its argmax could name a token the target lacks)."""
        if (
            self.graphs is None
            or any(request.temperature > 0 for _, request, _ in live)
            or logits[0].shape[-1] > self.vocab_size
        ):
            return False
        steps = [torch.stack(logits).argmax(dim=-1)]  # after the catch-up: each draft's first token
        for j in range(1, min(request.max_tokens for _, request, _ in live)):
            # Placeholder tokens: the step reads its inputs from the previous step's argmax.
            items = [
                StepItem([0], len(seq.fed) + j - 1, seq.pages, "last", state_slot=seq.slot)
                for _, _, seq in live
            ]
            ids = self.graphs.run_greedy(items, steps[-1])
            if ids is None:
                break
            steps.append(ids)
        for (i, _, seq), drafted in zip(live, torch.stack(steps, dim=1).tolist()):
            tokens[i] += drafted
            seq.fed += drafted[:-1]  # the last one is fed by the next step, or the next catch-up
        return True

    def _choose(
        self, request: DraftRequest, seq: _Sequence, logits: torch.Tensor, tokens: list, probs: list
    ) -> None:
        """The draft's next token from the draft model's ``logits``: the argmax for a greedy job,
        else a draw at the job's temperature (its distribution kept as the proposal)."""
        token, q = pick(logits, request.temperature, self.vocab_size, seq.generator)
        tokens.append(token)
        if q is not None:
            probs.append(q)
