"""The Generator: many jobs at once over one paged cache (continuous batching).

Each call to :meth:`Generator.iterate` runs one forward step that mixes every active job's work:
jobs still reading their prompt contribute a chunk of it (prefill), the others one token each
(decode). New jobs join as soon as pages are free; finished or cancelled jobs leave and free
their pages at once. Full pages are registered by content (see ``engine.cache.pages``), so a
job whose prompt starts with pages already computed - the previous turn of the same chat - skips
straight past them. A model with recurrent layers skips as far as a snapshot of their state goes
(``engine.cache.snapshots``): a prompt's prefill stops on the page boundaries where a snapshot is
due (:func:`~engine.cache.snapshots.snapshot_positions`), and the state left there is copied into
the pool between steps, so no step or mixer needs to hand out a state from inside a chunk. A
decode step that fills a page leaves one too, so a chat's next turn skips the reply's full pages
as well; a pipelined step's copy is queued right behind it, held until its tokens come back and
name the page (``_hold_snapshots``).

Sampled jobs draw on the GPU (``engine.kernels.sampling.sample_tokens``): each job's uniform
comes from its own seeded generator on the host, as the host sampler would draw it, and only the
chosen ids come back instead of a vocabulary-sized row per job (``EngineOptions.sampling_on_device``
off samples on the host instead). A step where any job uses a processor the kernel does not apply
(a constraint's mask, a logit bias: ``engine.generation.device_sampling.sampling_path``) samples
every row on the host, by the same reference.

Decode steps drawn where the logits are (argmax or device sampler) are pipelined on a GPU (with
CUDA graphs): the next step is launched from the tokens the last one left on the device, before
the host reads them, so the host's work per token (stop checks, streaming, preparing the step)
overlaps the GPU's instead of idling it (``EngineOptions.pipelined_decode`` off turns this off).
Plain greedy batches take each row's argmax there. Batches with a sampled (or penalised greedy)
job are drawn there, greedy rows at temperature 0: the penalty lists are packed from the host's tokens, which
lack the token still on the device, and the sampler counts that one as a *pending* token (as if
appended); each job's uniform is drawn from its generator when its step is launched, in the order
the unpipelined path draws them, so a seeded job gives the same tokens either way. Steps sampled
on the host and steps that do not fit a graph are not pipelined. A job that ends at a token
wastes the one step already launched for it (and, if sampled, one uniform of its finished
generator); that step only wrote a cache slot past the job's end.
"""

from __future__ import annotations

import numbers
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from engine import kernels
from engine.cache.paged import PagedKVCache
from engine.cache.pages import page_keys
from engine.cache.snapshots import snapshot_positions
from engine.errors import ContextOverflowError, UsageError
from engine.generation.constraints import ConstraintError, ConstraintState
from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.decode_inputs import decode_rows, is_decode_item, run_decode_step
from engine.generation.device_sampling import SamplingRows, pack_rows, sample_reference, sampling_path
from engine.generation.job import Job, JobResult, Timings
from engine.generation.rewind import RewindPoints, rewind_cache
from engine.generation.samplers.banned_strings import BannedStringGuard
from engine.generation.samplers.dry import breaker_ids
from engine.generation.sampling import Sampler
from engine.generation.speculative import acceptance
from engine.generation.speculative.drafter import Drafter
from engine.generation.speculative.factory import make_drafter
from engine.generation.speculative.speculation import Speculation
from engine.generation.step import StepItem, run_step, run_step_with_hidden
from engine.generation.stops import StopStringMatcher
from engine.model import LoadedModel
from engine.options import DEFAULT_OPTIONS, EngineOptions

# A pipelined step's tokens go to the host on a side stream (see _InFlight.start; +1.2% decode
# tok/s on the 1B shape, docs/KERNELS.md section 8), and a sampled step's inputs (settings,
# penalty lists, uniforms) go to the GPU on another (see _upload_aside; +0.4%).
_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """One side stream per GPU and ``role`` ("tokens": copies to the host; "uploads": to the GPU)."""
    key = (device, role)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


@dataclass(eq=False)
class _Running:
    job: Job
    tokens: list[int]  # prompt, then every sampled token
    prompt_len: int
    limit: int  # the sequence may grow to this many tokens
    sampler: Sampler
    stops: StopStringMatcher
    stop_ids: set[int]
    decoder: object | None
    constraint: ConstraintState | None = None  # masks the logits, advances with each token
    pages: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its recurrent-state slot, where the model keeps one
    in_cache: int = 0  # positions 0 .. in_cache - 1 are in the cache
    keys: list[bytes] = field(default_factory=list)  # keys of the full pages registered so far
    snapshot_at: list[int] = field(default_factory=list)  # prompt positions still to snapshot
    # (page end, snapshot-pool row) of each launched decode step that fills a page, until read
    held_snapshots: list[tuple[int, int]] = field(default_factory=list)
    decode_snapshot: bytes | None = None  # key of the last snapshot its decode steps kept
    # Banned strings: the text held back, and checkpoints of recurrent state to rewind to.
    guard: BannedStringGuard | None = None
    rewind_points: RewindPoints | None = None
    cached_tokens: int = 0
    t_enqueued: float = 0.0
    t_started: float | None = None
    t_first: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def prefilling(self) -> bool:
        return self.in_cache < self.prompt_len


@dataclass(eq=False)
class _InFlight:
    """A decode step launched but not yet read: its rows' runs and their next tokens (argmaxes,
    or draws of the device sampler when ``sampled``)."""

    runs: list[_Running]
    ids: torch.Tensor  # [len(runs)] int64, on the model's device
    host: torch.Tensor  # the same, being copied to the host
    copied: torch.cuda.Event | None  # recorded after the copy (None on the CPU)
    sampled: bool = False

    @classmethod
    def start(cls, runs: list[_Running], ids: torch.Tensor, sampled: bool = False) -> _InFlight:
        if not ids.is_cuda:
            return cls(runs, ids, ids, None, sampled)
        # The copy to the host goes on a stream of its own: on the compute stream it sat between
        # this step and the next one's input copy, copy-engine transitions (~7 us each on the
        # H200, profile-step's idle gaps) with no kernel running.
        copier = _side_stream(ids.device, "tokens")
        copier.wait_stream(torch.cuda.current_stream(ids.device))
        ids.record_stream(copier)  # the allocator must not reuse ids before the copy has read them
        with torch.cuda.stream(copier):
            host = ids.to("cpu", non_blocking=True)  # pinned: really asynchronous
            copied = torch.cuda.Event()
            copied.record()
        return cls(runs, ids, host, copied, sampled)

    def tokens(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def _argmax_rows(logits: list) -> dict[int, int]:
    """``{item index: argmax of its last logit row}`` for the items that have logits, in one
    batched argmax and one transfer (ties: the first maximum, as ``torch.argmax`` everywhere)."""
    present = [(i, row[-1]) for i, row in enumerate(logits) if row is not None]
    if not present:
        return {}
    rows = torch.stack([row for _, row in present])
    found = kernels.sampling.argmax_rows(rows)
    ids = (found if found is not None else rows.argmax(dim=-1)).tolist()
    return {i: int(token) for (i, _), token in zip(present, ids)}


def _draw_rows(
    runs: list[_Running], logits: torch.Tensor, pending: torch.Tensor | None = None
) -> torch.Tensor:
    """Each run's next token drawn where ``logits`` ``[len(runs), vocab]`` are
    (:func:`engine.kernels.sampling.sample_tokens`, one launch; elsewhere its torch reference),
    as a device tensor not waited for: each job's
    uniform from its own generator (drawn only where the host sampler would draw one), its
    settings and penalty lists packed on the host from its tokens. ``pending`` (int64, on the
    device): each row's last token, not yet in the run's tokens (a pipelined step); the
    penalties count it as appended."""
    settings = [run.sampler.settings for run in runs]
    contexts = [
        run.sampler.context_ids(run.tokens) if s.repetition_penalty != 1.0 else ()
        for run, s in zip(runs, settings)
    ]
    rows = pack_rows(settings, contexts, [run.generated for run in runs])
    u = torch.tensor(
        [0.0 if s.is_greedy else run.sampler.next_uniform() for run, s in zip(runs, settings)],
        dtype=torch.float32,
    )
    device = logits.device
    if device.type == "cuda":
        u = u.pin_memory()  # a copy from pageable memory would wait for the GPU: no pipelining
        rows_d, u_d = _upload_aside(device, rows, u)
    else:
        rows_d, u_d = rows.to(device), u.to(device)
    ids = kernels.sampling.sample_tokens(logits, rows_d, u_d, pending=pending)
    return ids if ids is not None else sample_reference(logits, rows_d, u_d, pending)


def _upload_aside(
    device: torch.device, rows: SamplingRows, u: torch.Tensor
) -> tuple[SamplingRows, torch.Tensor]:
    """``rows`` and ``u`` (pinned) copied to ``device`` on a side stream that the current stream
    then waits for. They are the host's numbers, not the step's: on the compute stream the copies
    queued behind the step's graph and put two copy-engine transitions between it and the draw."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device, "uploads")
    with torch.cuda.stream(side):
        rows_d, u_d = rows.to(device, non_blocking=True), u.to(device, non_blocking=True)
    main.wait_stream(side)
    rows_d.record_stream(main)  # allocated on the side stream, used (and freed) on this one
    u_d.record_stream(main)
    return rows_d, u_d


def _sample_rows(runs: list[_Running], logits: list) -> dict[int, int]:
    """``{item index: token}`` for the items that have logits, drawn where the logits are
    (:func:`_draw_rows`), a few bytes back."""
    present = [(i, row[-1]) for i, row in enumerate(logits) if row is not None]
    if not present:
        return {}
    ids = _draw_rows([runs[i] for i, _ in present], torch.stack([row for _, row in present]))
    return {i: int(token) for (i, _), token in zip(present, ids.tolist())}


def _with_tokens(items: list[StepItem], ids: torch.Tensor) -> list[StepItem]:
    """Single-token decode ``items`` with their tokens taken from ``ids`` (read to the host)."""
    tokens = ids.tolist()
    return [replace(i, tokens=[t]) for i, t in zip(items, tokens)]


class Generator:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer=None,
        cache: PagedKVCache | None = None,
        max_batch_size: int = 16,
        max_chunk_tokens: int | None = None,
        cache_tokens: int | None = None,
        page_size: int = 64,
        cache_bits: tuple[int, int] = (16, 16),
        options: EngineOptions = DEFAULT_OPTIONS,
        drafter: Drafter | None = None,
    ) -> None:
        """``options``: how decode steps run (:class:`~engine.options.EngineOptions`: CUDA graphs,
        pipelining, sampling where the logits are, the batched decode path, step tuning, the
        drafter of speculative decoding). ``drafter``: one to use instead of ``options.draft``'s."""
        self.model, self.tokenizer = model, tokenizer
        self.options = options
        on_gpu = model.device.type == "cuda"
        if cache is None:
            tokens = cache_tokens or min(model.spec.max_position_embeddings, 8192)
            cache = PagedKVCache.for_model(
                model.spec,
                tokens,
                page_size,
                model.dtype,
                model.device,
                cache_bits,
                max_batch_size,
                states=model.cache_states,
                devices=model.layer_devices,
            )
        self.cache = cache
        if max_chunk_tokens is None:
            # A GPU prefills long prompts fastest in big steps: each EXL3 linear decodes its weight
            # once per step (reconstruct + cuBLAS), so 512-token steps would decode it 8x for 4K.
            max_chunk_tokens = 4096 if model.device.type == "cuda" else 512
        self.max_batch_size, self.max_chunk_tokens = max_batch_size, max_chunk_tokens
        # A long prompt of a model with recurrent layers leaves a state snapshot every this many
        # pages: where a lone prompt's chunks end anyway (chunks start on page boundaries), so
        # the checkpoints cost no extra step.
        self.snapshot_every = max(1, max_chunk_tokens // self.cache.page_size)
        self._queue: deque[_Running] = deque()
        self._active: list[_Running] = []
        self._by_job: dict[Job, _Running] = {}
        self.prefilled_tokens = 0  # statistics: prompt tokens actually computed
        self._use_graphs = options.cuda_graphs and on_gpu
        dynamic = getattr(model.module, "dynamic_decode", None)
        if self._use_graphs and dynamic:
            # E.g. a mixture-of-experts block whose experts the device-routed kernels do not take
            # (engine.modules.moe) reads its per-expert token counts on the host and runs only the
            # chosen experts, on as many rows as chose them: no fixed shapes for a graph to
            # capture. Such a model decodes eagerly (and so, by default, without pipelining).
            print(
                f"trellis: {dynamic} model: decode steps run without CUDA graphs "
                "(the work of each step depends on its tokens)",
                file=sys.stderr,
            )
            self._use_graphs = False
        self._graphs: DecodeGraphs | None = None
        # Pipelining pays where graphs run; elsewhere it only costs syncs, but works (CPU tests).
        pipeline = options.pipelined_decode
        self._pipeline = self._use_graphs if pipeline is None else pipeline
        self._flight: _InFlight | None = None
        # Off the GPU "device" sampling is the kernel's torch reference (CPU tests).
        on_device = options.sampling_on_device
        self._device_sampling = on_gpu if on_device is None else on_device
        # On the CPU the row-by-row path reads the cache in place and is the faster one.
        batched = options.batched_decode
        self._batched_decode = on_gpu if batched is None else batched
        # Speculative decoding (engine.generation.speculative): a verify step needs the host to
        # know each job's last token to draft from it, so it is never pipelined.
        if drafter is None:
            drafter = make_drafter(
                options.draft, model, tokenizer, self.cache, max_batch_size, options.cuda_graphs
            )
        self.speculation = (
            Speculation(drafter, options.draft_tokens, self.cache) if drafter is not None else None
        )

    # -- queue ------------------------------------------------------------------------------

    def enqueue(self, job: Job) -> None:
        prompt = list(job.input_ids)
        if not prompt:
            raise UsageError("a job needs at least one input token")
        budget = job.max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
            # Zero or less would end the job only after its first token (the limit is checked
            # once a token is appended), and a negative limit falls below the prompt.
            raise UsageError(f"max_new_tokens must be a whole number >= 1, got {budget!r}")
        sampler = Sampler(job.sampling)  # validates the settings before any other work
        context = self.context_length
        if len(prompt) >= context:
            where = (
                "cache"
                if self.cache.capacity < self.model.spec.max_position_embeddings
                else "model's context"
            )
            raise ContextOverflowError(
                f"prompt of {len(prompt)} tokens does not fit the {where} of {context} tokens "
                "(leave room for at least one new token)"
            )
        stop_ids = set(job.stop_token_ids) if job.stop_token_ids is not None else self._default_stop_ids()
        banned = list(job.sampling.banned_strings)
        if banned and (self.tokenizer is None or job.constraint is not None):
            # A rewind needs the text (a tokenizer) and a constraint that could step back too.
            raise UsageError(
                "banned strings need a generator with a tokenizer"
                if self.tokenizer is None
                else "banned strings cannot be combined with a constraint (JSON schema, regex, grammar)"
            )
        if job.sampling.dry_multiplier > 0:
            sampler.breakers = breaker_ids(self.tokenizer, job.sampling.dry_sequence_breakers)
        constraint = None
        if job.constraint is not None:
            if self.tokenizer is None:
                raise ConstraintError("a constrained job needs a generator with a tokenizer")
            # Starts computing the first mask on a worker thread, overlapping the prefill. With
            # the job's token budget it steers the output to finish before the limit.
            constraint = job.constraint.start(
                self.tokenizer, budget=min(job.max_new_tokens, context - len(prompt))
            )
        run = _Running(
            job=job,
            tokens=prompt,
            prompt_len=len(prompt),
            limit=min(len(prompt) + job.max_new_tokens, context),
            sampler=sampler,
            stops=StopStringMatcher(job.stop_strings),
            stop_ids=stop_ids,
            decoder=self.tokenizer.incremental_decoder() if self.tokenizer is not None else None,
            constraint=constraint,
            t_enqueued=time.perf_counter(),
        )
        if banned:
            run.guard = BannedStringGuard(banned)
            run.rewind_points = RewindPoints(self.cache, run.guard.window)
        self._queue.append(run)
        self._by_job[job] = run

    @property
    def context_length(self) -> int:
        """The longest a job's sequence (prompt and reply) can grow: the model's context or the
        cache's capacity, whichever is smaller."""
        return min(self.model.spec.max_position_embeddings, self.cache.capacity)

    def _default_stop_ids(self) -> set[int]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def cancel(self, job: Job) -> None:
        """Stop a job now and free its pages (full ones stay cached for reuse)."""
        run = self._by_job.get(job)
        if run is None:
            return
        if run in self._active:
            self._finish(run)
        else:
            self._queue.remove(run)
            del self._by_job[job]

    @property
    def num_remaining_jobs(self) -> int:
        return len(self._queue) + len(self._active)

    def prefill_progress(self, job: Job) -> tuple[int, int] | None:
        """(tokens read, tokens to read) of ``job``'s prompt, not counting the part served from
        cached pages; None once it is read (or the job is unknown). A front end shows it while a
        long prompt takes seconds before the first token."""
        run = self._by_job.get(job)
        if run is None or not run.prefilling:
            return None
        return run.in_cache - run.cached_tokens, run.prompt_len - run.cached_tokens

    def _admit(self) -> None:
        ps = self.cache.page_size
        while self._queue and len(self._active) < self.max_batch_size:
            run = self._queue[0]
            needed = -(-run.limit // ps)
            if needed > self.cache.num_pages:
                self._queue.popleft()
                self._by_job.pop(run.job, None)
                raise ContextOverflowError(
                    f"job needs {needed} pages of {ps} tokens; the cache has {self.cache.num_pages}"
                )
            # Reuse cached pages of the prompt's prefix, but always compute the last prompt
            # token ourselves: its logits give the first new token.
            reusable = page_keys(self._key_tokens(run, run.prompt_len - 1), ps)
            matched = self.cache.pages.match_prefix(reusable)
            snapshots = self.cache.snapshots
            if snapshots is not None:  # recurrent layers: resume where their state was kept
                resume = snapshots.resume_point(reusable[: len(matched)])
                self.cache.pages.release(matched[resume:])
                matched = matched[:resume]
            if needed - len(matched) > self.cache.pages.available or self.cache.state_slots.exhausted:
                self.cache.pages.release(matched)
                return  # wait for running jobs to free pages
            run.pages = matched + self.cache.pages.allocate(needed - len(matched))
            run.state_slot = self.cache.state_slots.allocate()
            run.keys = reusable[: len(matched)]
            run.in_cache = run.cached_tokens = len(matched) * ps
            if snapshots is not None:
                if matched:  # the snapshot hangs on a page the run now holds: it is still there
                    snapshots.restore(run.keys[-1], run.state_slot)
                run.snapshot_at = snapshot_positions(run.prompt_len, run.in_cache, ps, self.snapshot_every)
            self._queue.popleft()
            self._active.append(run)

    # -- stepping ---------------------------------------------------------------------------

    def iterate(self) -> list[JobResult]:
        """Run one forward step; returns one result per job that produced something (with a
        pipelined step in flight: the tokens of that step, the next one already launched)."""
        if self._flight is not None:
            return self._land()
        self._admit()
        if not self._active:
            return []
        items, runs = [], []
        budget = self.max_chunk_tokens
        decoding = [run for run in self._active if not run.prefilling]
        drafts = self.speculation.propose(decoding) if self.speculation is not None else {}
        for run in decoding:  # decode first: one token each (and drafts), never starved by prefill
            if run.rewind_points is not None:
                run.rewind_points.maybe_take(run.state_slot, run.in_cache)
            # Its last token, or more where the cache is behind (rejected drafts of a model with
            # recurrent state, a rewind); a draft's tokens follow, with logits at every position.
            draft = drafts.get(run)
            tokens = run.tokens[run.in_cache :] + (draft.tokens if draft else [])
            wanted = len(draft) + 1 if draft else "last"
            items.append(StepItem(tokens, run.in_cache, run.pages, wanted, run.job.media, run.state_slot))
            runs.append(run)
            budget -= len(tokens)
        now = time.perf_counter()
        for run in self._active:
            if run.prefilling and budget > 0:
                end = min(run.prompt_len, run.in_cache + budget)
                if run.snapshot_at and run.snapshot_at[0] < end:
                    end = run.snapshot_at[0]  # the step leaves the state there to snapshot
                if run.job.media is not None:  # never split an image attended bidirectionally
                    end = run.job.media.chunk_end(run.in_cache, end)
                chunk = run.tokens[run.in_cache : end]
                wanted = "last" if end == run.prompt_len else None
                items.append(StepItem(chunk, run.in_cache, run.pages, wanted, run.job.media, run.state_slot))
                runs.append(run)
                budget -= len(chunk)
                self.prefilled_tokens += len(chunk)
                if run.t_started is None:
                    run.t_started = now
        # Plain greedy jobs need only each row's argmax, and jobs whose processors the kernel all
        # applies are drawn by it: either way where the logits are (on a GPU: one launch and a
        # few bytes back instead of a vocab-sized copy). Other steps sample on the host.
        path = sampling_path(
            [run.sampler.settings for run in runs],
            [run.constraint is not None for run in runs],
            self._device_sampling,
        )
        argmax_only, on_device = path == "argmax", path == "device"
        if hasattr(self.model.module, "argmax_only"):  # ranks then pass each row's best id alone
            self.model.module.argmax_only = argmax_only and self.speculation is None
        # (Not with a drafter: the next step's drafts need this step's tokens on the host.)
        pipelined = self._pipeline and self.speculation is None and not self._queue
        pipelined = pipelined and all(map(is_decode_item, items))
        if pipelined and (argmax_only or on_device):
            ids = self._launch_greedy(items) if argmax_only else self._launch_sampled(items, runs)
            if ids is not None:
                self._flight = _InFlight.start(runs, ids, sampled=on_device)
                self._hold_snapshots(runs, items)
                return []
        hidden = None
        if self.speculation is not None and self.speculation.wants_hidden:
            # An MTP drafter reads every position's final hidden state: the general step path.
            logits, hidden = run_step_with_hidden(self.model.module, self.cache, items)
        else:
            logits = self._decode_with_graphs(items, to_cpu=not (argmax_only or on_device))
            if logits is None:
                logits = self._eager_step(items)
        plain = [None if run in drafts else row for run, row in zip(runs, logits)]  # verify rows apart
        if argmax_only:
            chosen = _argmax_rows(plain)
        else:
            chosen = _sample_rows(runs, plain) if on_device else {}
        results = []
        for i, (run, item, row) in enumerate(zip(runs, items, logits)):
            if run in drafts:  # how far its cache goes depends on what is accepted
                results.append(self.speculation.land(self, run, item, row, drafts[run]))
                continue
            run.in_cache += len(item.tokens)
            self._register_full_pages(run)
            if run.snapshot_at:
                self._take_snapshot(run)
            elif self._fills_page(run, item) and len(run.keys) * self.cache.page_size == run.in_cache:
                self._keep_decode_snapshot(run, run.keys[-1])
            if row is not None:
                results.append(self._advance(run, row[-1], chosen.get(i)))
        if hidden is not None:  # after the tokens are chosen: the drafter reads them too
            self.speculation.observe(self, runs, items, hidden)
        return results

    def _decode_with_graphs(self, items: list[StepItem], to_cpu: bool):
        """The step's logits from a CUDA graph when it is all single-token decodes that fit one
        (see ``engine.generation.cuda_graph``); None: run it eagerly."""
        if not self._use_graphs:
            return None
        return self._decode_graphs().run(items, to_cpu=to_cpu)

    def _decode_graphs(self) -> DecodeGraphs:
        if self._graphs is None or self._graphs.cache is not self.cache:  # new cache: new graphs
            # Up to 8 sequences; a verify step takes 1 + k rows per sequence (engine.generation.
            # decode_inputs.decode_rows), up to 64 rows in all.
            rows = 8 if self.speculation is None else min(64, 8 * (1 + self.speculation.max_tokens))
            self._graphs = DecodeGraphs(
                self.model.module, self.cache, max_batch=rows, tune_splits=self.options.step_tuning
            )
        return self._graphs

    def _launch_greedy(self, items: list[StepItem], ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Launch a decode-only greedy step; its next tokens as a device tensor (not waited for),
        or None where it cannot run pipelined. ``ids``: the input tokens on the device (the items'
        own tokens are then placeholders)."""
        if self._use_graphs:
            return self._decode_graphs().run_greedy(items, ids)
        return self._eager_last_logits(items, ids).argmax(dim=-1)

    def _eager_last_logits(self, items: list[StepItem], ids: torch.Tensor | None) -> torch.Tensor:
        """The step run eagerly: each item's last logits ``[len(items), vocab]``. ``ids``: the
        input tokens on the device (the step needs them on the host, so they are read there)."""
        if ids is not None:
            items = _with_tokens(items, ids)
        return torch.stack([row[-1] for row in self._eager_step(items)])

    def _eager_step(self, items: list[StepItem]) -> list[torch.Tensor | None]:
        """``run_step`` for a step no graph replays; decode and verify steps batched
        (``batched_decode``)."""
        if self._batched_decode and decode_rows(items) is not None:
            return run_decode_step(self.model.module, self.cache, items)
        return run_step(self.model.module, self.cache, items)

    def _launch_sampled(
        self, items: list[StepItem], runs: list[_Running], ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Launch a decode-only step of jobs drawn on the device (greedy rows at
        temperature 0); its next tokens as a device tensor (not waited for), or None where it
        cannot run pipelined (then no uniform is drawn). ``ids``: the input tokens on the device,
        not yet in the runs' tokens: the items' own tokens are placeholders, and the draw counts
        ``ids`` as each row's pending token."""
        if self._use_graphs:
            logits = self._decode_graphs().run_logits(items, ids)
            if logits is None:
                return None
        else:
            logits = self._eager_last_logits(items, ids)
        return _draw_rows(runs, logits, ids)

    def _land(self) -> list[JobResult]:
        """Read the step in flight. Before waiting for it, launch the next one from its tokens on
        the device for every run that may go on (still active, not at its length limit), unless
        jobs wait to join (then the next step is a normal one that admits them)."""
        flight, self._flight = self._flight, None
        following = None
        rows = [
            i for i, run in enumerate(flight.runs) if run in self._active and len(run.tokens) + 1 < run.limit
        ]
        if rows and not self._queue:
            runs = [flight.runs[i] for i in rows]
            items = [
                StepItem([0], run.in_cache + 1, run.pages, "last", state_slot=run.state_slot) for run in runs
            ]
            ids = flight.ids
            if len(rows) < len(flight.runs):
                ids = ids[torch.tensor(rows, device=ids.device)]
            if flight.sampled:
                out = self._launch_sampled(items, runs, ids)
            else:
                out = self._launch_greedy(items, ids)
            if out is not None:
                following = _InFlight.start(runs, out, flight.sampled)
                self._hold_snapshots(runs, items)
        results = []
        for run, token in zip(flight.runs, flight.tokens()):
            if run not in self._active:  # cancelled while its step ran
                continue
            run.in_cache += 1
            self._register_full_pages(run)
            if run.held_snapshots and run.held_snapshots[0][0] == run.in_cache:
                _, row = run.held_snapshots.pop(0)
                self._keep_decode_snapshot(run, run.keys[-1], row)
            results.append(self._advance(run, None, token))
        if following is not None and any(run in self._active for run in following.runs):
            self._flight = following  # rows of jobs that just ended are skipped when it lands
        return results

    @staticmethod
    def _key_tokens(run: _Running, count: int) -> list:
        """The first ``count`` tokens as page keys see them: image placeholders stand for their
        image's content hash, so pages holding different images never match."""
        media = run.job.media
        tokens = run.tokens[:count]
        return tokens if media is None else media.key_tokens(tokens)

    def _register_full_pages(self, run: _Running) -> None:
        ps = self.cache.page_size
        settled = run.in_cache
        if run.guard is not None:  # a page a banned string's rewind may still reach is not named
            settled = min(settled, run.prompt_len + run.guard.count - run.guard.held_tokens)
        full = settled // ps
        known = len(run.keys)
        if full > known:
            # Hash only the pages filled since the last call, chained on the last known key.
            fresh = self._key_tokens(run, full * ps)[known * ps :]
            new = page_keys(fresh, ps, run.keys[-1] if run.keys else None)
            run.keys += new
            for page, key in zip(run.pages[known:full], new):
                self.cache.pages.register(page, key)

    def _take_snapshot(self, run: _Running) -> None:
        """Snapshot the run's state if its step ended where one is due. A position its chunk went
        past (an image is never split) gets none."""
        while run.snapshot_at and run.snapshot_at[0] <= run.in_cache:
            at = run.snapshot_at.pop(0)
            key = run.keys[at // self.cache.page_size - 1]
            if at == run.in_cache and self.cache.pages.holds(key):  # it hangs on a known page
                self.cache.snapshots.save(key, run.state_slot)

    def _fills_page(self, run: _Running, item: StepItem) -> bool:
        """Whether ``item``, a step of ``run``, is a decode step that fills a page whose state
        is worth keeping: the model has recurrent layers and pages are named."""
        return (
            self.cache.snapshots is not None
            and self.cache.pages.reuse_prefixes
            and item.past >= run.prompt_len
            and (item.past + len(item.tokens)) % self.cache.page_size == 0
        )

    def _hold_snapshots(self, runs: list[_Running], items: list[StepItem]) -> None:
        """After launching a pipelined decode step: copy the state of each row that fills a page
        into a held row of the pool, queued behind the step and before the next one advances the
        state. The page's key needs the step's input token, still on the device: ``_land`` files
        the row once it is read; a job that ends first drops it (``_finish``)."""
        if self.cache.snapshots is None:
            return
        for run, item in zip(runs, items):
            if self._fills_page(run, item):
                row = self.cache.snapshots.hold(run.state_slot)
                if row is not None:
                    run.held_snapshots.append((item.past + 1, row))

    def _keep_decode_snapshot(self, run: _Running, key: bytes, row: int | None = None) -> None:
        """Keep the run's state after a decode step that filled the page named ``key``: held
        ``row`` (a pipelined step), or the slot's state now. It replaces the run's previous
        decode snapshot: a chat's next turn resumes from the reply's last full page, and a long
        reply so takes one row of the pool instead of evicting other sequences' snapshots."""
        pool = self.cache.snapshots
        if key in pool or not self.cache.pages.holds(key):  # the same state kept, or no page
            if row is not None:
                pool.drop(row)
            return
        if run.decode_snapshot is not None:
            pool.discard(run.decode_snapshot)
        if row is None:
            pool.save(key, run.state_slot)
        else:
            pool.file(row, key)
        run.decode_snapshot = key

    def _advance(
        self,
        run: _Running,
        logits,
        token: int | None = None,
        draft: tuple[int, torch.Tensor | None] | None = None,
    ) -> JobResult:
        """Sample the next token from ``logits`` (or take ``token``, already chosen as their
        argmax for a plain greedy job) and report what it adds. ``draft``: the drafted token at
        this position of a verify step and its proposal distribution (None: a point mass); the
        acceptance rule then picks the token (``engine.generation.speculative.acceptance``)."""
        if token is None:
            mask = None
            if run.constraint is not None:
                try:
                    mask = run.constraint.allowed(logits.shape[-1], run.stop_ids)
                except ConstraintError as exc:  # the constraint engine failed: end this job only
                    return self._constraint_dead_end(run, str(exc))
                if mask is None:  # no token can continue the constrained output
                    return self._constraint_dead_end(run)
            if draft is None:
                token = run.sampler.sample(logits, run.tokens, run.generated, mask)
            else:
                token = acceptance.pick(run.sampler, logits, run.tokens, run.generated, mask, *draft)
            if run.constraint is not None:
                try:
                    token = self._keep_room_to_finish(run, logits, token)
                except ConstraintError as exc:
                    return self._constraint_dead_end(run, str(exc))
        now = time.perf_counter()
        if run.t_first is None:
            run.t_first = now
        run.tokens.append(token)
        text, reason, error = "", None, None
        ids = [token]
        if token in run.stop_ids:
            reason = "eos"
        else:
            piece = run.decoder.add(token) if run.decoder is not None else ""
            if run.guard is not None:  # text that may start a banned string is held back
                piece, ids, back = run.guard.feed(token, piece)
                if back is not None:
                    return self._rewind(run, run.prompt_len + back, now)
            text, hit = run.stops.feed(piece)
            if hit:
                reason = "stop_string"
            elif len(run.tokens) >= run.limit:
                # A full context wins over a spent budget: a larger budget would not have helped.
                reason = "context_length" if len(run.tokens) >= self.context_length else "max_new_tokens"
        if run.constraint is not None:
            reason, error = self._advance_constraint(run, token, reason)
        if reason is not None and reason != "stop_string":
            tail = run.decoder.flush() if run.decoder is not None else ""
            if run.guard is not None:  # the end: no banned string can complete any more
                held, held_ids = run.guard.finish()
                tail = held + tail
                ids = held_ids + ids if reason == "eos" else ids + held_ids
            more, _ = run.stops.feed(tail)
            text += more + run.stops.flush()
        result = self._result(run, text, ids, reason, error, now)
        if result.done:
            self._finish(run)
        return result

    def _rewind(self, run: _Running, length: int, now: float) -> JobResult:
        """A banned string appeared: keep the first ``length`` tokens, ban token ``length`` at its
        position and let the next step draw it again (``engine.generation.samplers``). Nothing is
        reported: the dropped tokens' text was still held back."""
        dropped = run.tokens[length]
        del run.tokens[length:]
        bans = run.sampler.bans
        for position in [p for p in bans if p > length]:  # they were bans after another prefix
            del bans[position]
        bans.setdefault(length, set()).add(dropped)
        run.decoder = self.tokenizer.incremental_decoder()
        for token in run.tokens[run.prompt_len :]:  # its state after the kept tokens
            run.decoder.add(token)
        rewind_cache(self.cache, run, length, run.rewind_points)
        return self._result(run, "", [], None, None, now)

    def _result(
        self,
        run: _Running,
        text: str,
        token_ids: list[int],
        reason: str | None,
        error: str | None,
        now: float,
    ) -> JobResult:
        return JobResult(
            job=run.job,
            text=text,
            token_ids=token_ids,
            done=reason is not None,
            stop_reason=reason,
            prompt_tokens=run.prompt_len,
            cached_tokens=run.cached_tokens,
            new_tokens=len(run.generated),
            timings=Timings(
                queued_s=(run.t_started or now) - run.t_enqueued,
                prefill_s=run.t_first - (run.t_started or run.t_first),
                decode_s=now - run.t_first,
            ),
            error=error,
        )

    def _finish(self, run: _Running) -> None:
        """A job is over: it leaves the batch and its pages go back (full ones stay cached)."""
        self._active.remove(run)
        self._by_job.pop(run.job, None)
        if self.speculation is not None:
            self.speculation.forget(run)
        self.cache.pages.release(run.pages)
        self.cache.state_slots.release(run.state_slot)
        for _, row in run.held_snapshots:  # launched steps whose tokens it will never read
            self.cache.snapshots.drop(row)
        run.held_snapshots.clear()

    def _advance_constraint(
        self, run: _Running, token: int, reason: str | None
    ) -> tuple[str | None, str | None]:
        """Feed the sampled token to the job's constraint; the stop reason and error that follow."""
        state = run.constraint
        try:
            state.advance(token, is_stop=token in run.stop_ids)
        except ConstraintError as exc:  # the mask should prevent this; report it, don't hang
            return "constraint_error", str(exc)
        if state.complete:
            # A JSON document is over at its last bracket: stop there (no need to sample EOS).
            if reason in (None, "max_new_tokens", "context_length"):
                reason = "constraint_complete"  # even where a length limit fell on the same token
            return reason, None
        if reason in ("max_new_tokens", "context_length", "stop_string"):
            return reason, (
                f"the {state.constraint.kind} output is incomplete: generation stopped ({reason}) "
                f"after {len(run.generated)} tokens, before the constraint was satisfied"
            )
        return reason, None

    @staticmethod
    def _keep_room_to_finish(run: _Running, logits, token: int) -> int:
        """``token``, or if it would leave too few tokens of the budget to finish the
        constrained output, a token drawn again among those on the shortest way to the end."""
        state = run.constraint
        if state.fits(token, is_stop=token in run.stop_ids):
            return token
        closing = state.closing_mask(logits.shape[-1], run.stop_ids)
        if closing is None:
            return token
        return run.sampler.sample(logits, run.tokens, run.generated, closing)

    def _constraint_dead_end(self, run: _Running, error: str | None = None) -> JobResult:
        """End a job whose constraint allows no next token (e.g. it needs a character no token
        of this vocabulary can produce), or whose constraint engine failed (``error``)."""
        now = time.perf_counter()
        run.t_first = run.t_first or now
        text = run.decoder.flush() if run.decoder is not None else ""
        more, _ = run.stops.feed(text)
        self._finish(run)
        error = error or (
            f"the {run.constraint.constraint.kind} constraint cannot be satisfied: no token of "
            f"the vocabulary can follow the {len(run.generated)} tokens generated so far"
        )
        return self._result(run, more + run.stops.flush(), [], "constraint_error", error, now)

    # -- conveniences -----------------------------------------------------------------------

    def stream(self, job: Job) -> Iterator[JobResult]:
        """Enqueue one job and yield its results as they come (other jobs run alongside)."""
        self.enqueue(job)
        while job in self._by_job:
            for result in self.iterate():
                if result.job is job:
                    yield result

    def generate(self, jobs: Sequence[Job]) -> list[JobResult]:
        """Run jobs to completion together; one merged result (whole text, all ids) per job."""
        merged = {job: JobResult(job, "", []) for job in jobs}
        for job in jobs:
            self.enqueue(job)
        while self.num_remaining_jobs:
            for r in self.iterate():
                m = merged[r.job]
                m.text += r.text
                m.token_ids += r.token_ids
                m.done, m.stop_reason, m.new_tokens, m.timings = (
                    r.done,
                    r.stop_reason,
                    r.new_tokens,
                    r.timings,
                )
                m.error = r.error
                m.prompt_tokens, m.cached_tokens = r.prompt_tokens, r.cached_tokens
        return [merged[job] for job in jobs]
