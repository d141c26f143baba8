"""Rank 0's model: the rank's shard behind the ``CausalLM`` interface the Generator drives.

Each forward first broadcasts the step (:class:`~engine.parallel.step_plan.StepPlan`) so that
the other ranks run the same step on their shards, then runs rank 0's shard; the collectives
inside the shards pair up, and the vocabulary-parallel head gathers the logits on rank 0 (or, for
a step the Generator only takes argmaxes of, each row's best id: ``argmax_only``). A cache
rank 0 has not seen before is announced first, and its snapshot pool is recorded from then on
(:mod:`engine.parallel.snapshot_mirror`). Nothing else of the Generator changes: scheduling,
paging, prefix reuse and sampling stay on rank 0, and so does a vision tower: its image
embeddings travel with the step that reads them. On CUDA, decode steps replay CUDA graphs that
every rank captures alike (:attr:`LeaderModule.graph_hooks`, :mod:`engine.parallel.graph_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from engine.cache.paged import PagedKVCache
from engine.modules.batch import BatchLayout
from engine.modules.decoder import CausalLM
from engine.modules.splice import InputSplice
from engine.parallel import messages
from engine.parallel.graph_steps import LeaderGraphHooks
from engine.parallel.snapshot_mirror import RecordedSnapshots
from engine.parallel.step_plan import CacheSetup, DropGraphs, GraphStep, StepPlan
from engine.parallel.vocab import set_argmax_only

# What a failed collective becomes: the run names the rank that ended (engine.parallel.launch).
ErrorTranslator = Callable[[BaseException], BaseException]
T = TypeVar("T")


class LeaderModule(nn.Module):
    def __init__(self, inner: CausalLM, translate: ErrorTranslator | None = None) -> None:
        super().__init__()
        self.inner = inner
        self._translate = translate or (lambda exc: exc)
        self._caches: dict[int, PagedKVCache] = {}  # announced caches, kept so ids stay unique
        # Why a step failed part way: the ranks' collectives no longer pair up, so no later step
        # may run (the run has to start again).
        self._broken: BaseException | None = None
        # Set by the Generator before a step whose rows it only takes the argmax of (plain
        # greedy): the ranks then move each row's best (value, id), not its whole vocabulary.
        self.argmax_only = False
        self.graph_hooks = LeaderGraphHooks(self)  # read by engine.generation.cuda_graph

    @property
    def broken(self) -> BaseException | None:
        """Why a step failed part way (the run must start again), or None."""
        return self._broken

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def dynamic_decode(self) -> str | None:
        # Every rank replays the same graphs (graph_hooks): rank 0's shard decides, as alone.
        return self.inner.dynamic_decode

    @property
    def static_decode(self) -> bool:
        return self.inner.static_decode

    @property
    def blocks(self) -> nn.ModuleList:
        return self.inner.blocks

    @property
    def embedding(self) -> nn.Module:
        return self.inner.embedding

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: BatchLayout,
        cache: PagedKVCache,
        logit_rows: torch.Tensor | None = None,
        splice: InputSplice | None = None,
    ) -> torch.Tensor:
        def step() -> torch.Tensor:
            cache_id = self._announce(cache)
            ops = self._cache_ops(cache)
            messages.send(
                StepPlan.capture(cache_id, input_ids, batch, logit_rows, splice, ops, self.argmax_only)
            )
            set_argmax_only(self.inner, self.argmax_only)
            return self.inner(input_ids, batch, cache, logit_rows, splice=splice)

        return self._guarded(step)

    def announce_graph(self, cache: PagedKVCache, key: tuple, capture: bool) -> None:
        """Tell the other ranks to capture (``capture``) or replay the decode graph ``key``
        ``(batch, pages, argmax_only)`` over ``cache``, as rank 0 is about to."""
        batch, pages, argmax_only = key

        def send() -> None:
            cache_id = self._announce(cache)
            ops = self._cache_ops(cache)
            messages.send(GraphStep(cache_id, batch, pages, bool(argmax_only), capture, ops))

        self._guarded(send)

    def tell(self, message: object) -> None:
        """Send the other ranks ``message`` (one their loop knows: ``engine.parallel.follower``)."""
        self._guarded(lambda: messages.send(message))

    def drop_graphs(self, cache: PagedKVCache) -> None:
        """Rank 0's capture failed: the other ranks drop ``cache``'s graphs too."""
        self._guarded(lambda: messages.send(DropGraphs(self._announce(cache))))

    @staticmethod
    def _cache_ops(cache: PagedKVCache) -> list:
        return cache.snapshots.drain() if isinstance(cache.snapshots, RecordedSnapshots) else []

    def _guarded(self, work: Callable[[], T]) -> T:
        """``work()``, which talks to the other ranks; a failure breaks the run for good (the
        ranks' collectives no longer pair up), named after the rank that ended where one did."""
        if self._broken is not None:
            raise RuntimeError(
                f"the tensor-parallel run failed earlier ({self._broken}); load the model again"
            )
        try:
            return work()
        except RuntimeError as exc:  # a collective failed (another rank is gone), or this rank did
            self._broken = self._translate(exc)
            if self._broken is exc:
                raise
            raise self._broken from exc
        except BaseException as exc:
            self._broken = exc
            raise

    def _announce(self, cache: PagedKVCache) -> int:
        key = id(cache)
        if key not in self._caches:
            pool = cache.snapshots
            messages.send(
                CacheSetup(
                    key,
                    cache.num_pages,
                    cache.page_size,
                    self.dtype,
                    cache.bits,
                    cache.state_slots.count,
                    None if pool is None else pool.capacity,
                )
            )
            if pool is not None:
                recorded = RecordedSnapshots(pool)
                cache.snapshots = recorded
                cache.pages.on_forget = recorded.discard
            self._caches[key] = cache
        return key
