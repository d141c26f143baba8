"""CUDA graphs for the decode step: captured once per shape, replayed every step.

For a small model a decode step is hundreds of tiny kernels, and launching them from Python
costs more than running them. A CUDA graph records the launches once and replays them with one
call. It needs fixed shapes and fixed addresses, which the fixed-shape decode path gives
(``engine.generation.decode_inputs``): per (batch bucket, page bucket) one :class:`DecodeInputs`
buffer and one graph over it. A step writes its inputs to the buffer (one host-to-device copy)
and replays.

Batch buckets are every row count up to ``exact_rows`` (8), then powers of two (16, 32, ...; up
to ``max_batch``): a batch of 12 runs the 16-row graph with four padding rows. A speculative
verify item (a token and ``k`` drafted ones) takes ``1 + k`` rows
(``engine.generation.decode_inputs.decode_rows``), so verify steps replay from the same graphs as
decode steps of as many rows. The small counts are exact because a step's cost grows with its
rows (the GEMVs' MMA columns, each row's attention over its keys, the head): a k = 4 verify step
padded to 8 rows would pay for 8.

Page buckets are powers of two from ``min_pages`` up to ``max_pages``, so a short sequence does
not pay for reading a whole padded table in attention, and a sequence growing from empty to the
whole cache causes only a handful of captures. Graphs are captured lazily, on first use, and
share one memory pool (only one replays at a time). Anything that does not fit (more sequences
or pages than the largest bucket, no page free for padding) returns None: the caller runs the
eager step instead.

A model may take part in a step with other processes (a tensor-parallel run's rank 0,
``engine.parallel.graph_steps``): its :class:`GraphHooks` then say what a graph's step runs, what
else a graph depends on (part of its key), and tell the other ranks before each capture and
replay, so that every rank captures and replays the same graphs in the same order.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence

import torch

from engine import kernels
from engine.cache.paged import PagedKVCache
from engine.generation.decode_inputs import (
    DecodeInputs,
    decode_forward,
    decode_rows,
    is_decode_item,
    pages_needed,
)
from engine.generation.step import StepItem
from engine.modules.decoder import CausalLM

WARMUP_STEPS = 2
# Step tuning (engine.kernels.tuning.tune_step) times a candidate as the median of these rounds of
# replays of its captured step.
TUNE_ROUNDS = 5
TUNE_REPLAYS = 8


# Row counts up to this many have graphs of their own; more rows pad to a power of two.
EXACT_ROWS = 8


def _bucket(n: int, limit: int, smallest: int = 1, exact: int = 0) -> int:
    """``n`` itself up to ``exact``, else the smallest power of two >= ``n`` and >= ``smallest``;
    capped at ``limit`` (callers check ``n <= limit``)."""
    if n <= exact:
        return n
    b = smallest
    while b < n:
        b *= 2
    return min(b, limit)


class GraphHooks:
    """How a decode graph's step runs and whom it tells: the single-process default, the model
    alone. A model that steps with other processes offers its own as ``model.graph_hooks``."""

    # Other processes take part in each step: every capture and replay must be announced, so no
    # capture of one's own (step tuning times whole steps by capturing them) is allowed.
    shared = False

    def variant(self) -> Hashable:
        """What the next step's graph depends on besides its shape (part of its key)."""
        return None

    def forward(self, model: CausalLM, cache: PagedKVCache, inputs: DecodeInputs, variant: Hashable):
        """The step to warm up and capture: logits ``[batch, vocab]`` from ``inputs``' buffer."""
        return decode_forward(model, cache, inputs)

    def before_capture(self, cache: PagedKVCache, key: tuple) -> None:
        """The graph ``key`` (batch, pages, variant) is about to be warmed up and captured."""

    def before_replay(self, cache: PagedKVCache, key: tuple) -> None:
        """The graph ``key`` is about to be replayed (its inputs are on the device)."""

    def capture_failed(self, cache: PagedKVCache) -> None:
        """A capture failed: every later step over ``cache`` runs eagerly."""


class _Graph:
    """One captured decode shape: its input buffer, the graph and its static output."""

    def __init__(self, inputs: DecodeInputs, key: tuple = ()) -> None:
        self.inputs = inputs
        self.key = key  # (batch, pages, the hooks' variant)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.keepalive: tuple = ()  # buffers outside the pool the graph writes to


class DecodeGraphs:
    """Replays decode steps of ``model`` over ``cache`` from CUDA graphs (a CUDA model only).

    :meth:`run` returns the same as ``run_step(model, cache, items)`` for decode and verify
    items, or None when they do not fit a graph. Bound to one cache: make a new instance for a new cache.
    """

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        max_batch: int = 8,
        max_pages: int | None = None,
        min_pages: int = 8,
        tune_splits: bool = False,
        exact_rows: int = EXACT_ROWS,
    ) -> None:
        """``exact_rows``: row counts with graphs of their own (above them, powers of two).
        ``tune_splits``: before the first capture of a step shape, revise the GEMVs' split
        counts by timing whole steps (engine.kernels.tuning.tune_step; ``EngineOptions.step_tuning``)."""
        self.model, self.cache = model, cache
        self.hooks: GraphHooks = getattr(model, "graph_hooks", None) or GraphHooks()
        self.tune_splits = tune_splits and not self.hooks.shared
        self.max_batch = max_batch
        self.exact_rows = exact_rows
        self.max_pages = min(max_pages or cache.num_pages, cache.num_pages)
        self.min_pages = min_pages
        self.device = model.device
        self.failed: str | None = None  # why capture failed; then run() always returns None
        dynamic = getattr(model, "dynamic_decode", None)  # the Generator decodes these eagerly too
        if dynamic:
            self.failed = f"a {dynamic} step has data-dependent shapes"
        self._graphs: dict[tuple, _Graph] = {}  # by (batch, pages, the hooks' variant)
        self._pool = None
        self.replays = 0  # steps replayed from a graph (statistics, tests)

    def _pages(self, rows: Sequence[StepItem]) -> int | None:
        """Block-table columns the step's decode rows need, or None when they do not fit a graph."""
        if self.failed is not None or not 0 < len(rows) <= self.max_batch:
            return None
        pages = pages_needed(rows, self.cache.page_size)
        return pages if pages <= self.max_pages else None

    def fits(self, items: Sequence[StepItem]) -> bool:
        expanded = decode_rows(items)
        return expanded is not None and self._pages(expanded[0]) is not None

    @torch.inference_mode()
    def run(self, items: Sequence[StepItem], to_cpu: bool = False) -> list[torch.Tensor] | None:
        """One decode step through a graph: ``[1, vocab]`` float32 logits per item, or None.

        ``to_cpu``: return them on the CPU, all rows in one transfer (the sampler reads them
        there anyway; one copy instead of one per sequence).
        """
        expanded = decode_rows(items)
        if expanded is None:
            return None
        rows, spans = expanded
        logits = self._replay(rows)
        if logits is None:
            return None
        # The static output is overwritten by the next replay: hand out a copy.
        logits = logits.cpu() if to_cpu else logits.clone()
        return [logits[first:end] for first, end in spans]

    @torch.inference_mode()
    def run_greedy(self, items: Sequence[StepItem], ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """One decode step through a graph, returning each item's greedy next token as a device
        tensor ``[len(items)]`` (int64), without waiting for it; or None (run it eagerly).

        ``ids``: the items' input tokens as a device tensor (the previous step's result, not yet
        on the host); the items' own ``tokens`` are then placeholders. Ties: the first maximum.
        """
        logits = self._replay(items, ids)
        if logits is None:
            return None
        ids = kernels.sampling.argmax_rows(logits)
        return ids if ids is not None else logits.argmax(dim=-1)

    @torch.inference_mode()
    def run_logits(self, items: Sequence[StepItem], ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """One decode step through a graph, returning its float32 logits ``[len(items), vocab]``
        on the device without waiting for them (for a draw there, e.g. a pipelined sampled step);
        or None (run it eagerly). ``ids``: as for :meth:`run_greedy`. The tensor is the graph's
        static output: use it (in stream order) before the next replay overwrites it."""
        return self._replay(items, ids)

    def _replay(self, items: Sequence[StepItem], ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Fill the inputs, capture on first use, replay: the graph's static logits ``[n, vocab]``
        (valid until the next replay), or None when the items do not fit a graph. ``items``: one
        decode row each."""
        if not all(map(is_decode_item, items)):
            return None
        needed = self._pages(items)
        if needed is None:
            return None
        batch = _bucket(len(items), self.max_batch, exact=self.exact_rows)
        pages = _bucket(needed, self.max_pages, self.min_pages)
        # Padding rows write their keys/values into a page held only for this step. It is freed
        # right after: nothing reads it, and a job that gets it later writes before it reads.
        # Their recurrent state (if any) is the cache's scratch slot, which no sequence holds.
        scratch = None
        if batch > len(items):
            if self.cache.pages.available == 0:
                return None
            (scratch,) = self.cache.pages.allocate(1)
        key = (batch, pages, self.hooks.variant())
        try:
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = _Graph(
                    DecodeInputs(batch, pages, self.cache.page_size, self.device), key
                )
            entry.inputs.fill(items, scratch, self.cache.state_slots.scratch)
            if ids is not None:  # stream-ordered after the step that produced them
                entry.inputs.buffer[: len(items)].copy_(ids)
            if entry.graph is None and not self._capture(entry):
                return None
            self.hooks.before_replay(self.cache, key)
            entry.graph.replay()
            self.replays += 1
            return entry.logits[: len(items)]
        finally:
            if scratch is not None:
                self.cache.pages.release([scratch])

    def _capture(self, entry: _Graph) -> bool:
        """Warm up on a side stream, then capture (torch's documented recipe). The inputs
        already hold a real step: the warm-up computes it, writing the same keys and values the
        replay then writes again. Recurrent state is not idempotent (a step advances it), so
        while warming up, tuning and capturing every row's state slot is the scratch slot; the
        real slots are back in the inputs for the replay that follows."""
        slots = entry.inputs.state_slots()
        real_slots = slots.clone()
        slots.fill_(self.cache.state_slots.scratch)
        try:
            self.hooks.before_capture(self.cache, entry.key)
            captured = self._warm_up_and_capture(entry)
        finally:
            slots.copy_(real_slots)
        if not captured:
            self.hooks.capture_failed(self.cache)
        return captured

    def _warm_up_and_capture(self, entry: _Graph) -> bool:
        step, variant = self.hooks.forward, entry.key[2]
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), kernels.tuning.recorded_keys() as keys:
                for _ in range(WARMUP_STEPS):
                    step(self.model, self.cache, entry.inputs, variant)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.tune_splits:
                tuning = kernels.tuning.tune_step_once(sorted(keys, key=repr), lambda: self._time_step(entry))
                if tuning is not None:
                    print(
                        f"trellis: split counts tuned for the {describe_step(entry)}: {tuning.summary()}",
                        file=sys.stderr,
                    )
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's calls are checked while capturing (the app decodes
            # on a worker thread; another thread's unrelated CUDA call must not fail the capture).
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = step(self.model, self.cache, entry.inputs, variant)
        except Exception as exc:  # an op that cannot be captured: stay eager from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            print(f"trellis: CUDA graph capture failed ({self.failed}); decoding eagerly", file=sys.stderr)
            self._graphs.clear()
            return False
        entry.graph, entry.logits = graph, logits
        # The workspace GEMVs' buffers (the expert GEMV's too) are baked into the graph by address;
        # a later, larger model gets new ones: keep the captured ones alive with the graph.
        entry.keepalive = (*kernels.gemv.workspaces(), *kernels.moe.workspaces())
        return True

    def _time_step(self, entry: _Graph) -> float:
        """ms of one replay of the step in ``entry.inputs`` captured with the current split counts
        (its own graph and memory, freed on return): the median of :data:`TUNE_ROUNDS` rounds.
        Every replay writes the same keys and values, as the warm-up does."""
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                decode_forward(self.model, self.cache, entry.inputs)
            graph.replay()
            rounds = [kernels.tuning.replay_ms(graph, stream, TUNE_REPLAYS) for _ in range(TUNE_ROUNDS)]
        torch.cuda.current_stream(self.device).wait_stream(stream)
        del graph
        return sorted(rounds)[len(rounds) // 2]

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch, pages) shapes captured so far."""
        return sorted({key[:2] for key, g in self._graphs.items() if g.graph is not None})


def describe_step(entry: _Graph) -> str:
    """The captured step's shape in words (log lines)."""
    return f"decode step of batch {entry.inputs.batch} ({entry.inputs.max_pages} pages)"
