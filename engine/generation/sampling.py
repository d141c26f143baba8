"""Turning next-token logits into a token: one batched reference, written as a list of processors.

:func:`sample_reference` is the one definition of sampling. It is the CPU path (the host
:class:`Sampler` runs it on a batch of one row), the caller's fallback where
:func:`engine.kernels.sampling.sample_tokens` has no kernel (no CUDA extension), and the oracle the
GPU kernel (``ext/sampling.cu``) is tested against (tests/cuda/test_sampling_kernel.py: the same
token for the same uniform). Each row goes through:

1. the *logit processors* (:data:`LOGIT_PROCESSORS`), on the raw logits, in order: the logit bias
   (``{id: bias}`` added first, OpenAI's semantics), the repetition penalty over the context's
   distinct ids (CTRL-style: positive logits divided, negative ones multiplied), presence and
   frequency penalties over the generated tokens (OpenAI-style), DRY over the whole context, a
   constraint's mask, the tokens a banned string's rewind banned at this position;
2. greedy rows (temperature 0 or top_k 1) take the first argmax here;
3. the *distribution processors* (:data:`DISTRIBUTION_PROCESSORS`): temperature, then top-n-sigma,
   top-k, typical-p, top-p and min-p, each setting the tokens it drops to -inf, then XTC;
4. the draw: integer weights ``floor(exp(x - max) * 2**44)`` (exact, order-independent sums, so
   the kernel's atomics and this reference agree bit for bit), and the first token in ascending id
   order whose cumulative weight exceeds ``floor(u * total)``, ``u`` the job's own uniform.

Each :class:`Processor` is a batched ``[rows, vocab] -> [rows, vocab]`` function, says when a
row's settings make it do something (``active``), and whether the kernel applies it (``device``).
Where a batch is drawn (:func:`engine.generation.device_sampling.sampling_path`) is all or
nothing: on the device (the kernel on a GPU) only when every active processor of every row is one
the kernel applies, otherwise every row on the host, through this reference. Running the covered
processors on the device and only the others on the host would save a copy of the logits, but
the kernel fuses all of its processors into one launch over the raw logits: a host-only processor
can only run first (as torch operations on the device) if it comes before all of them, and the
constraint's mask does not. A host row costs its logits' copy and one to a few milliseconds of
CPU at a 128k vocabulary, which only a step using a host-only processor pays; in exchange a new
sampler (DRY, XTC, banned strings) is one function and one entry in a list here, with no CUDA to
touch, until a kernel covers it and its flag flips.

Order and ties, as the kernel takes them: top-p's mass is over what top-k kept, and min-p's
threshold is relative to the best token, which every truncation keeps, so min-p cuts the same
tokens before or after top-p (the kernel computes both thresholds from top-k's survivors). Tokens
of equal logit are kept or dropped together: top-k keeps every token equal to the k-th largest,
and top-p's "tokens ranked strictly before" are those of strictly greater logit.

Speed (every sampled host token pays it, next to a GPU decode step of a few milliseconds): the
whole vocabulary is never sorted unless a rule needs it (a 128k-token sort costs ~13 ms on a
laptop core): top-k takes ``torch.topk`` of the largest k, top-p grows a top-k window (64 tokens,
then 8x) until it holds the cutoff, min-p is a threshold on the logits, the draw one cumulative
sum.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.generation.samplers import dry, token_bans, top_n_sigma, typical, xtc
from engine.generation.sampling_settings import SETTINGS, SamplingSettings, Setting

__all__ = [
    "DISTRIBUTION_PROCESSORS",
    "HostRow",
    "LOGIT_PROCESSORS",
    "PROCESSORS",
    "SETTINGS",
    "SETTING_FIELDS",
    "Processor",
    "Sampler",
    "SamplingBatch",
    "SamplingRows",
    "SamplingSettings",
    "Setting",
    "active_processors",
    "apply_penalties",
    "apply_penalties_rows",
    "pack_rows",
    "process_logits",
    "sample_reference",
    "truncate",
]

# -- a batch's inputs ------------------------------------------------------------------------

# Columns of the per-row settings tensor, in the kernel's order.
SETTING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
WEIGHT_SCALE = 2.0**44
_TOP_K_CAP = 1 << 24  # top_k travels as float32: exact up to 2^24, far above any vocabulary
_NEG_INF = float("-inf")


@dataclass
class SamplingRows:
    """A batch's numeric sampling inputs as tensors (one device), what the kernel takes:
    ``settings`` ``[rows, 7]`` float32 in :data:`SETTING_FIELDS` order; the repetition penalty's
    distinct context ids ``rep_ids`` ``[rows, cap]`` int32, ``rep_len[r]`` of them valid; the
    generated tokens' distinct ids ``gen_ids`` and their occurrence counts ``gen_counts``
    ``[rows, cap]`` int32, ``gen_len[r]`` valid. Ids must be distinct within a row (the kernel
    would penalise a repeated id twice).

    :func:`pack_rows` makes every field a view of one int32 buffer (``buffer``), so that moving
    a batch to the GPU is one copy, not six: this runs once per sampled token."""

    settings: torch.Tensor
    rep_ids: torch.Tensor
    rep_len: torch.Tensor
    gen_ids: torch.Tensor
    gen_counts: torch.Tensor
    gen_len: torch.Tensor
    buffer: torch.Tensor | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return self.settings.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SamplingRows:
        if self.buffer is None:
            return SamplingRows(*(t.to(device, non_blocking=non_blocking) for t in self._tensors()))
        return _views(self.buffer.to(device, non_blocking=non_blocking), self.rows, *self._caps())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell the caching allocator that ``stream`` uses these (CUDA) tensors."""
        for t in (self.buffer,) if self.buffer is not None else self._tensors():
            t.record_stream(stream)

    def _caps(self) -> tuple[int, int]:
        return self.rep_ids.shape[1], self.gen_ids.shape[1]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.settings, self.rep_ids, self.rep_len, self.gen_ids, self.gen_counts, self.gen_len)


def _views(buffer: torch.Tensor, rows: int, rep_cap: int, gen_cap: int) -> SamplingRows:
    """The fields of a batch packed in ``buffer`` (int32): settings (float32 bits), rep_ids,
    rep_len, gen_ids, gen_counts, gen_len, one after another."""
    sizes = (rows * len(SETTING_FIELDS), rows * rep_cap, rows, rows * gen_cap, rows * gen_cap, rows)
    parts = buffer.split(sizes)
    return SamplingRows(
        parts[0].view(torch.float32).view(rows, len(SETTING_FIELDS)),
        parts[1].view(rows, rep_cap),
        parts[2],
        parts[3].view(rows, gen_cap),
        parts[4].view(rows, gen_cap),
        parts[5],
        buffer,
    )


def _padded(lists: Sequence[np.ndarray], cap: int) -> np.ndarray:
    """``lists`` as one flat ``[len(lists) * cap]`` int32 array, each padded with zeros to ``cap``."""
    out = np.zeros((len(lists), cap), dtype=np.int32)
    for r, x in enumerate(lists):
        out[r, : len(x)] = x
    return out.reshape(-1)


def _ids(values: torch.Tensor | Sequence[int]) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.numpy().astype(np.int32, copy=False)
    return np.asarray(values, dtype=np.int32)


def pack_rows(
    settings: Sequence[SamplingSettings],
    context_ids: Sequence[torch.Tensor | Sequence[int]],
    generated: Sequence[Sequence[int]],
    pin: bool | None = None,
) -> SamplingRows:
    """The batch's :class:`SamplingRows` on the CPU, every field a view of one int32 buffer.
    ``context_ids``: each row's distinct context ids (what the repetition penalty divides; e.g.
    ``Sampler.context_ids``); ``generated``: each row's generated tokens (repeats counted for the
    frequency penalty). Lists a row's settings do not use stay empty. ``pin``: page-lock the buffer
    so a non-blocking copy to the GPU is really asynchronous (default: where CUDA is present).

    Built in numpy and handed to torch once: this runs every sampled token, and a dozen small
    torch operations cost ~0.2 ms on a laptop core."""
    n = len(settings)
    table = np.array([[float(getattr(s, f)) for f in SETTING_FIELDS] for s in settings], dtype=np.float32)
    table = table.reshape(n, len(SETTING_FIELDS))
    top_k = SETTING_FIELDS.index("top_k")
    table[:, top_k] = np.minimum(table[:, top_k], _TOP_K_CAP)
    empty = np.zeros(0, dtype=np.int32)
    reps, gens, counts = [], [], []
    for s, ctx, gen in zip(settings, context_ids, generated):
        reps.append(_ids(ctx) if s.repetition_penalty != 1.0 else empty)
        if (s.presence_penalty or s.frequency_penalty) and len(gen):
            ids, k = np.unique(_ids(list(gen)), return_counts=True)
            gens.append(ids)
            counts.append(k.astype(np.int32))
        else:
            gens.append(empty)
            counts.append(empty)
    rep_cap = max((len(x) for x in reps), default=0)
    gen_cap = max((len(x) for x in gens), default=0)
    flat = np.concatenate(
        [
            table.view(np.int32).reshape(-1),
            _padded(reps, rep_cap),
            np.array([len(x) for x in reps], dtype=np.int32),
            _padded(gens, gen_cap),
            _padded(counts, gen_cap),
            np.array([len(x) for x in gens], dtype=np.int32),
        ]
    )
    buffer = torch.from_numpy(flat)
    if torch.cuda.is_available() if pin is None else pin:
        buffer = buffer.pin_memory()
    return _views(buffer, n, rep_cap, gen_cap)


@dataclass(frozen=True)
class HostRow:
    """What host-only processors read of one row besides its settings: the ``context`` (prompt
    and reply so far; DRY), DRY's sequence-breaker ids, the ids ``banned`` at this position (a
    banned string's rewinds) and XTC's coin ``xtc_u`` for this token (XTC acts where it is below
    ``xtc_probability``)."""

    context: Sequence[int] = ()
    breakers: Collection[int] = frozenset()
    banned: Collection[int] = ()
    xtc_u: float = 1.0


class SamplingBatch:
    """What the processors read: the packed ``rows`` (on the logits' device), and for host-only
    processors each row's ``settings`` (e.g. the logit bias), a constraint ``mask`` (bool
    ``[rows, vocab]``, True = allowed) and ``host`` inputs (:class:`HostRow`). ``pending`` (int64
    ``[rows]``): each row's last generated token, not yet in its penalty lists (see
    :func:`apply_penalties_rows`)."""

    def __init__(
        self,
        rows: SamplingRows,
        device: torch.device,
        settings: Sequence[SamplingSettings] | None = None,
        mask: torch.Tensor | None = None,
        pending: torch.Tensor | None = None,
        host: Sequence[HostRow] | None = None,
    ) -> None:
        self.rows, self.settings, self.mask, self.pending = rows, settings, mask, pending
        self.host = host
        self.device = device
        self.column = dict(zip(SETTING_FIELDS, rows.settings.to(device).unbind(1)))
        self.greedy = (self.column["temperature"] <= 0) | (self.column["top_k"] == 1)

    def column_of(self, name: str) -> torch.Tensor:
        """Each row's value of setting ``name`` (float32 ``[rows]``): a kernel column, or read
        from ``settings`` for a host-only one (its default where the batch has no settings)."""
        if name in self.column:
            return self.column[name]
        values = [getattr(s, name) for s in self.settings] if self.settings else None
        if values is None:
            values = [getattr(SamplingSettings(), name)] * self.rows.rows
        return torch.tensor(values, dtype=torch.float32, device=self.device)


# -- the processors --------------------------------------------------------------------------
# Each takes the batch's float32 [rows, vocab] logits (the reference's own copy: it may write in
# place) and returns them processed. A row whose setting is neutral is left exactly as it was.


def _logit_bias(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    for r, s in enumerate(b.settings or ()):
        if s.logit_bias:
            ids = torch.tensor([int(t) for t in s.logit_bias], dtype=torch.long, device=x.device)
            bias = torch.tensor([float(v) for v in s.logit_bias.values()], device=x.device)
            inside = ids < x.shape[1]  # ids past this model's vocabulary are ignored
            x[r, ids[inside]] += bias[inside]
    return x


def _pending(b: SamplingBatch, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pending token and whether it is one to penalise (>= 0 and inside the vocabulary;
    an id past it is ignored, as out-of-range list ids are)."""
    pending = b.pending.to(b.device).long()
    return pending, (pending >= 0) & (pending < vocab)


def _listed(lists: torch.Tensor, length: torch.Tensor, on: torch.Tensor, vocab: int) -> torch.Tensor:
    """Which entries of the padded ``lists`` are real ids of rows where the penalty is on
    (out-of-range ids are ignored, as the kernel ignores them)."""
    cols = torch.arange(lists.shape[1], device=lists.device)
    return (cols < length.to(lists.device)[:, None]) & on[:, None] & (lists >= 0) & (lists < vocab)


def _repetition(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    rep = b.column["repetition_penalty"]
    on = rep != 1.0
    if not bool(on.any()):
        return x
    vocab = x.shape[1]
    lists = b.rows.rep_ids.to(b.device).long()
    listed = _listed(lists, b.rows.rep_len, on, vocab)
    r, c = listed.nonzero(as_tuple=True)
    ids = lists[r, c]
    if b.pending is not None:
        # The pending token is one more distinct id unless the list holds it: the same roundings.
        pending, real = _pending(b, vocab)
        extra = (real & on & ~(listed & (lists == pending[:, None])).any(1)).nonzero().squeeze(1)
        r, ids = torch.cat([r, extra]), torch.cat([ids, pending[extra]])
    picked, f = x[r, ids], rep[r]
    x[r, ids] = torch.where(picked > 0, picked / f, picked * f)
    return x


def _presence_frequency(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    presence, frequency = b.column["presence_penalty"], b.column["frequency_penalty"]
    on = (presence != 0) | (frequency != 0)
    if not bool(on.any()):
        return x
    vocab = x.shape[1]
    lists = b.rows.gen_ids.to(b.device).long()
    listed = _listed(lists, b.rows.gen_len, on, vocab)
    counts = b.rows.gen_counts.to(b.device)
    if b.pending is not None:
        pending, real = _pending(b, vocab)
        hit = listed & (lists == pending[:, None])  # the pending token's entry: one more occurrence
        counts = counts + hit.int()
        extra = (real & on & ~hit.any(1)).nonzero().squeeze(1)  # not generated before: count 1
    r, c = listed.nonzero(as_tuple=True)
    ids, amount = lists[r, c], counts[r, c].float()
    if b.pending is not None:
        r, ids = torch.cat([r, extra]), torch.cat([ids, pending[extra]])
        amount = torch.cat([amount, torch.ones(extra.numel(), device=b.device)])
    # One subtraction of the combined amount: the kernel's rounding.
    x[r, ids] = x[r, ids] - (presence[r] + frequency[r] * amount)
    return x


def _constraint(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    return x if b.mask is None else x.masked_fill_(~b.mask.to(x.device), _NEG_INF)


def _temperature(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    t = b.column["temperature"]
    return x.div_(torch.where(b.greedy, torch.ones_like(t), t)[:, None])  # greedy rows: unscaled


def _top_k(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    vocab = x.shape[1]
    k = b.column["top_k"].long()
    on = (k > 0) & (k < vocab)
    if not bool(on.any()):
        return x
    width = int(k[on].max())
    kth = x.topk(width, dim=1).values.gather(1, (k.clamp(1, width) - 1)[:, None])
    return x.masked_fill_(on[:, None] & (x < kth), _NEG_INF)  # ties with the k-th stay


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's largest logit ``[rows, 1]``, 0 for a dead row (every token -inf), so that its
    weights come out 0 rather than NaN."""
    m = x.max(1, keepdim=True).values
    return m.masked_fill_(m == _NEG_INF, 0.0)


def _weights(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Integer probability weights ``floor(exp(x - m) * 2**44)`` (int64) of logits ``x`` whose
    row maxima are ``m`` (broadcast): -inf weighs 0. Element by element, so a token's weight is
    the same whichever subset of the row it is computed with (torch's exp does not depend on an
    element's position), as the kernel's are.

    ``x - m`` is clamped at -64 first: every token below -30.5 weighs 0 either way, and exp of
    -inf or of a number that underflows takes a slow path on x86 (12x to 120x the time of a normal
    one; a temperature of 0.2 puts most of a vocabulary there)."""
    e = (x - m).clamp_(min=-64.0)
    return e.exp_().mul_(WEIGHT_SCALE).long()  # floor: the values are >= 0


def _top_p(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    top_p = b.column["top_p"]
    on = top_p < 1
    if not bool(on.any()):
        return x
    vocab = x.shape[1]
    m = _row_max(x)
    z = _weights(x, m).sum(1)  # top-k's cut tokens are -inf: the mass is over what top-k kept
    # Keep a token when the weight before it is < top_p * Z, i.e. < ceil(top_p * Z) (integers):
    # the cut is at the first position, in descending order, where the cumulative weight reaches
    # that target. Only a window of the largest logits is sorted, grown until it holds the cut.
    target = torch.ceil(top_p.double() * z.double()).long()[:, None]
    width = min(vocab, 64)
    while True:
        top = x.topk(width, dim=1).values
        cum = _weights(top, m).cumsum(1)
        if width == vocab or bool((cum[:, -1:] >= target)[on].all()):
            break
        width = min(vocab, width * 8)
    j = torch.searchsorted(cum, target)
    # Ties: every token of the cut's logit has the same weight before it, so all of them stay.
    cut = torch.where(on[:, None] & (j < width), top.gather(1, j.clamp(max=width - 1)), _NEG_INF)
    return x.masked_fill_(x < cut, _NEG_INF)


def _min_p(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    min_p = b.column["min_p"]
    on = min_p > 0
    if not bool(on.any()):
        return x
    # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p): no softmax needed.
    threshold = x.max(1, keepdim=True).values + torch.log(min_p)[:, None]  # -inf where off
    return x.masked_fill_(x < threshold, _NEG_INF)


@dataclass(frozen=True)
class Processor:
    """One step of the sampler. ``active(settings, constrained)``: whether it changes a row with
    these settings (a job with a constraint has ``constrained``); ``device``: whether
    ``ext/sampling.cu`` applies it (a batch with any active processor it lacks is drawn on the
    host); ``apply``: the batched reference."""

    name: str
    device: bool
    active: Callable[[SamplingSettings, bool], bool]
    apply: Callable[[torch.Tensor, SamplingBatch], torch.Tensor]


LOGIT_PROCESSORS: tuple[Processor, ...] = (
    Processor("logit_bias", False, lambda s, c: bool(s.logit_bias), _logit_bias),
    Processor("repetition_penalty", True, lambda s, c: s.repetition_penalty != 1.0, _repetition),
    Processor(
        "presence_frequency_penalty",
        True,
        lambda s, c: bool(s.presence_penalty or s.frequency_penalty),
        _presence_frequency,
    ),
    Processor("dry", False, lambda s, c: s.dry_multiplier > 0, dry.apply),
    Processor("constraint", False, lambda s, c: c, _constraint),
    # Active for every job with banned strings: any position may carry bans after a rewind.
    Processor("banned_strings", False, lambda s, c: bool(s.banned_strings), token_bans.apply),
)
# Skipped by greedy rows (they never change the argmax): inactive for them.
TRUNCATIONS: tuple[Processor, ...] = (
    Processor("top_n_sigma", False, lambda s, c: not s.is_greedy and s.top_n_sigma > 0, top_n_sigma.apply),
    Processor("top_k", True, lambda s, c: not s.is_greedy and s.top_k > 0, _top_k),
    Processor("typical_p", False, lambda s, c: not s.is_greedy and s.typical_p < 1.0, typical.apply),
    Processor("top_p", True, lambda s, c: not s.is_greedy and s.top_p < 1.0, _top_p),
    Processor("min_p", True, lambda s, c: not s.is_greedy and s.min_p > 0.0, _min_p),
)
DISTRIBUTION_PROCESSORS: tuple[Processor, ...] = (
    Processor("temperature", True, lambda s, c: not s.is_greedy, _temperature),
    *TRUNCATIONS,
    # Random (its own coin per token), so not a truncation that truncate() could replay.
    Processor("xtc", False, lambda s, c: not s.is_greedy and s.xtc_probability > 0, xtc.apply),
)
PROCESSORS: tuple[Processor, ...] = LOGIT_PROCESSORS + DISTRIBUTION_PROCESSORS


def active_processors(settings: SamplingSettings, constrained: bool = False) -> list[Processor]:
    """The processors that change a row with ``settings`` (none: plain greedy, the argmax of the
    raw logits)."""
    return [p for p in PROCESSORS if p.active(settings, constrained)]


# -- the reference ---------------------------------------------------------------------------


def _draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's first token in ascending id order whose cumulative weight exceeds
    ``floor(u * total)`` (a token of weight 0 is never drawn; a dead row answers 0)."""
    cum = _weights(x, _row_max(x)).cumsum(1)
    total = cum[:, -1]
    draw = torch.floor(u.double() * total.double()).long()
    draw = torch.minimum(draw, (total - 1).clamp(min=0))
    picked = torch.searchsorted(cum, draw[:, None], right=True).squeeze(1).clamp(max=x.shape[1] - 1)
    return torch.where(total > 0, picked, 0)


def process_logits(
    logits: torch.Tensor,
    rows: SamplingRows,
    pending: torch.Tensor | None = None,
    *,
    settings: Sequence[SamplingSettings] | None = None,
    mask: torch.Tensor | None = None,
    host: Sequence[HostRow] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every processor of :func:`sample_reference`, without the draw: ``(x, greedy, greedy_ids)``
    where ``x`` float32 ``[rows, vocab]`` holds what the draw reads for sampled rows (their
    integer weights, ``_weights``, are the distribution the draw follows), ``greedy`` (bool
    ``[rows]``) marks the greedy rows and ``greedy_ids`` their tokens (None where no row is
    greedy). Speculative decoding reads the distribution from here to accept or reject drafts."""
    x = logits.to(torch.float32, copy=True)  # the processors write in place
    b = SamplingBatch(rows, x.device, settings, mask, pending, host)
    for p in LOGIT_PROCESSORS:
        x = p.apply(x, b)
    greedy_ids = x.argmax(1) if bool(b.greedy.any()) else None  # the first maximum
    if bool(b.greedy.all()):
        return x, b.greedy, greedy_ids
    for p in DISTRIBUTION_PROCESSORS:
        x = p.apply(x, b)
    return x, b.greedy, greedy_ids


def sample_reference(
    logits: torch.Tensor,
    rows: SamplingRows,
    u: torch.Tensor,
    pending: torch.Tensor | None = None,
    *,
    settings: Sequence[SamplingSettings] | None = None,
    mask: torch.Tensor | None = None,
    host: Sequence[HostRow] | None = None,
) -> torch.Tensor:
    """One token id per row (int64 ``[rows]``, on the logits' device) from ``logits``
    ``[rows, vocab]`` (any float dtype), the rows' packed settings and penalty lists, and one
    uniform ``u`` ``[rows]`` in [0, 1) per row: every processor, then the draw (module docstring).
    ``pending``: each row's last token, not yet in its lists (:func:`apply_penalties_rows`).
    Host-only inputs: ``settings`` (each row's, for the logit bias and the samplers beyond the
    kernel's; None: none of them), ``mask`` (bool ``[rows, vocab]``, True = allowed) and ``host``
    (:class:`HostRow` per row). Without them this is what the kernel computes."""
    x, greedy, greedy_ids = process_logits(logits, rows, pending, settings=settings, mask=mask, host=host)
    if bool(greedy.all()):
        return greedy_ids
    drawn = _draw(x, u.to(x.device))
    return drawn if greedy_ids is None else torch.where(greedy, greedy_ids, drawn)


def weights_of(x: torch.Tensor) -> torch.Tensor:
    """The draw's integer weights (int64, same shape) of processed logits ``x`` ``[rows, vocab]``:
    a row's distribution is its weights over their sum."""
    return _weights(x, _row_max(x))


def draw_weights(weights: torch.Tensor, u: float) -> int:
    """The token a uniform ``u`` picks from 1-D integer ``weights``, as the draw picks it (the
    first token in id order whose cumulative weight exceeds ``floor(u * total)``)."""
    cum = weights.cumsum(0)
    total = int(cum[-1])
    if total <= 0:
        return 0
    target = min(int(u * total), total - 1)
    return int(torch.searchsorted(cum, torch.tensor([target]), right=True)[0].clamp(max=weights.numel() - 1))


def apply_penalties_rows(
    logits: torch.Tensor, rows: SamplingRows, pending: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``[rows, vocab]``: the logits after each row's penalties (a new tensor).

    ``pending`` (int64 ``[rows]``, optional): each row's last generated token, not yet in its
    lists (< 0: none; >= vocab: ignored, as out-of-range list ids are). The result is the one of
    lists packed with that token appended to the job's tokens: it joins the distinct context ids
    (penalised once, also when already there) and counts one more generated occurrence (a new
    entry of count 1 when it is not in ``gen_ids``)."""
    x = logits.to(torch.float32, copy=True)
    b = SamplingBatch(rows, x.device, pending=pending)
    return _presence_frequency(_repetition(x, b), b)


# -- one row on the host ---------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,
    s: SamplingSettings,
    context: Sequence[int],
    generated: Sequence[int],
    context_ids: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The 1-D ``logits`` after ``s``'s penalties (float32, a new tensor): :func:`apply_penalties_rows`
    for one row. ``context_ids``: the context's distinct ids, when the caller keeps them."""
    if context_ids is None:
        context_ids = sorted(set(context))
    rows = pack_rows([s], [context_ids], [generated], pin=False)
    return apply_penalties_rows(logits[None], rows)[0]


def truncate(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """The 1-D (temperature-scaled) ``logits`` with every token top-k, top-p or min-p drops set
    to -inf (float32); the best token always stays."""
    x = logits.float()[None].clone()
    b = SamplingBatch(pack_rows([s], [()], [()], pin=False), x.device, [s])
    for p in TRUNCATIONS:
        x = p.apply(x, b)
    return x[0]


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
        # DRY's sequence breakers as token ids (the generator resolves the strings with its
        # tokenizer: engine.generation.samplers.dry.breaker_ids), and the tokens banned at each
        # position by a banned string's rewinds (position = length of the context before it).
        self.breakers: frozenset[int] = frozenset()
        self.bans: dict[int, set[int]] = {}

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
        """One token id from the ``[vocab]`` ``logits``, by :func:`sample_reference` on the host.
        ``mask`` (bool ``[vocab]``, True = allowed, at least one True) restricts the choice, e.g.
        to what a constraint permits; it applies before truncation, so top-k/top-p/min-p choose
        among the allowed tokens. ``u``: the draw's uniform in [0, 1) (default:
        :meth:`next_uniform`; greedy draws none, as on the device)."""
        s = self.settings
        ids = self.context_ids(context) if s.repetition_penalty != 1.0 else ()
        rows = pack_rows([s], [ids], [generated], pin=False)
        host = self._host_row(context)
        if u is None:
            u = 0.0 if s.is_greedy else self.next_uniform()
        token = sample_reference(
            logits.float().cpu()[None],
            rows,
            torch.tensor([u], dtype=torch.float32),
            settings=[s],
            mask=None if mask is None else mask.cpu()[None],
            host=[host],
        )
        return int(token[0])

    def weights(
        self,
        logits: torch.Tensor,
        context: Sequence[int],
        generated: Sequence[int],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The integer weights (int64 ``[vocab]``) :meth:`sample` would draw from for these
        ``logits``, every processor applied (an XTC coin drawn where XTC is on); their normalised
        values are the job's distribution for the next token. For a sampled job only."""
        s = self.settings
        ids = self.context_ids(context) if s.repetition_penalty != 1.0 else ()
        rows = pack_rows([s], [ids], [generated], pin=False)
        x, _, _ = process_logits(
            logits.float().cpu()[None],
            rows,
            settings=[s],
            mask=None if mask is None else mask.cpu()[None],
            host=[self._host_row(context)],
        )
        return weights_of(x)[0]

    def _host_row(self, context: Sequence[int]) -> HostRow:
        """The host-only processors' inputs for the token after ``context`` (XTC's coin drawn from
        the job's generator here, before the draw's uniform, where XTC may act)."""
        s = self.settings
        coin = self.next_uniform() if s.xtc_probability > 0 and not s.is_greedy else 1.0
        return HostRow(
            context if s.dry_multiplier > 0 else (),
            self.breakers,
            self.bans.get(len(context), ()),
            coin,
        )

    def next_uniform(self) -> float:
        """The next uniform in [0, 1) of the job's generator (a float32 value): what a draw uses,
        here or on the device (the same stream of numbers either way)."""
        return float(torch.rand(1, generator=self.generator))
