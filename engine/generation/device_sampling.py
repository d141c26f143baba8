"""Sampling a batch of rows where the logits are: the torch reference of ``ext/sampling.cu``.

The host sampler (:mod:`engine.generation.sampling`) needs each row's logits on the CPU. On a GPU
the kernel takes the same decision on the device and hands back a few bytes per row; this module
defines that decision in torch, batched and vectorised, on any device. It is the CPU path of
:func:`engine.ops.sample_tokens` and the oracle of the kernel's tests, and packs a batch's
settings and penalty lists into the device tensors both take.

The decision (the host sampler's rules and order; the kernel's comment has the details):
penalties on the raw logits, greedy (temperature 0 or top_k 1: the first argmax), temperature,
top-k, min-p (``p_i >= min_p * p_max``), top-p (a token stays when the mass of the tokens ranked
strictly before it is below ``top_p``, the mass being over what top-k left), then the first kept
token in ascending id order whose cumulative probability exceeds ``u`` times the kept total.

Ties (equal logits at a top-k or top-p boundary) are kept or dropped together: top-k keeps every
token equal to the k-th largest, and "ranked strictly before" means "of strictly greater logit".
Probabilities are integer weights ``floor(exp(x - max) * 2**44)`` (exact, order-independent sums:
the kernel's atomics give the same result every run and this reference reproduces them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.generation.sampling import SamplingSettings

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


@dataclass
class SamplingRows:
    """A batch's sampling inputs as tensors (one device): ``settings`` ``[rows, 7]`` float32 in
    :data:`SETTING_FIELDS` order; the repetition penalty's distinct context ids ``rep_ids``
    ``[rows, cap]`` int32, ``rep_len[r]`` of them valid; the generated tokens' distinct ids
    ``gen_ids`` and their occurrence counts ``gen_counts`` ``[rows, cap]`` int32, ``gen_len[r]``
    valid. Ids must be distinct within a row (the kernel would penalise a repeated id twice).

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
) -> SamplingRows:
    """The batch's :class:`SamplingRows` on the CPU, every field a view of one int32 buffer
    (pinned where CUDA is present, so a non-blocking copy to the GPU is really asynchronous).
    ``context_ids``: each row's distinct context ids (what the repetition penalty divides; e.g.
    ``Sampler.context_ids``); ``generated``: each row's generated tokens (repeats counted for the
    frequency penalty). Lists a row's settings do not use stay empty.

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
    if torch.cuda.is_available():
        buffer = buffer.pin_memory()
    return _views(buffer, n, rep_cap, gen_cap)


def apply_penalties_rows(
    logits: torch.Tensor, rows: SamplingRows, pending: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``[rows, vocab]``: the logits after each row's penalties (a new tensor); the host's
    :func:`~engine.generation.sampling.apply_penalties` for every row at once, same roundings.

    ``pending`` (int64 ``[rows]``, optional): each row's last generated token, not yet in its
    lists (< 0: none; >= vocab: ignored, as out-of-range list ids are). The result is the one of
    lists packed with that token appended to the job's tokens: it joins the distinct context ids
    (penalised once, also when already there) and counts one more generated occurrence (a new
    entry of count 1 when it is not in ``gen_ids``)."""
    w = logits.float().clone()
    n, vocab = w.shape
    device = w.device
    _, _, _, _, rep, presence, frequency = rows.settings.to(device).unbind(1)
    index = torch.arange(n, device=device)[:, None]
    if pending is None:
        pending = torch.full((n,), -1, dtype=torch.long, device=device)
    pending = pending.to(device).long()
    has_pending = (pending >= 0) & (pending < vocab)

    def valid(ids: torch.Tensor, length: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        ids, length = ids.to(device), length.to(device)
        cols = torch.arange(ids.shape[1], device=device)
        return (cols < length[:, None]) & on[:, None] & (ids >= 0) & (ids < vocab)

    rep_on = rep != 1.0
    ok = valid(rows.rep_ids, rows.rep_len, rep_on)
    rep_ids = rows.rep_ids.to(device).long()
    listed = (ok & (rep_ids == pending[:, None])).any(1)
    # The pending token is one more distinct id unless the list holds it: the same roundings.
    extra = has_pending & rep_on & ~listed
    r = torch.cat([index.expand(-1, ok.shape[1])[ok], index[:, 0][extra]])
    ids = torch.cat([rep_ids[ok], pending[extra]])
    picked, f = w[r, ids], rep[r]
    w[r, ids] = torch.where(picked > 0, picked / f, picked * f)

    gen_on = (presence != 0) | (frequency != 0)
    ok = valid(rows.gen_ids, rows.gen_len, gen_on)
    gen_ids = rows.gen_ids.to(device).long()
    hit = ok & (gen_ids == pending[:, None])  # the pending token's entry: one more occurrence
    counts = rows.gen_counts.to(device) + hit.int()
    extra = has_pending & gen_on & ~hit.any(1)  # not generated before: a new entry of count 1
    r = torch.cat([index.expand(-1, ok.shape[1])[ok], index[:, 0][extra]])
    ids = torch.cat([gen_ids[ok], pending[extra]])
    counts = torch.cat([counts[ok], torch.ones_like(pending[extra], dtype=counts.dtype)]).float()
    w[r, ids] = w[r, ids] - (presence[r] + frequency[r] * counts)
    return w


def sample_reference(
    logits: torch.Tensor, rows: SamplingRows, u: torch.Tensor, pending: torch.Tensor | None = None
) -> torch.Tensor:
    """One token id per row (int64 ``[rows]``, on the logits' device) from ``logits``
    ``[rows, vocab]`` (any float dtype), the rows' settings and penalty lists, and one uniform
    ``u`` ``[rows]`` in [0, 1) per row: the decision ``ext/sampling.cu`` takes (module docstring).
    ``pending``: each row's last token, not yet in its lists (:func:`apply_penalties_rows`)."""
    device = logits.device
    w = apply_penalties_rows(logits, rows, pending)
    n, vocab = w.shape
    temperature, top_k, top_p, min_p = rows.settings.to(device).unbind(1)[:4]
    greedy = (temperature <= 0) | (top_k == 1)
    greedy_ids = w.argmax(1)  # the first maximum

    x = w / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    m = x.max(1).values
    dead = m == float("-inf")  # every token masked: the kernel answers 0
    m = torch.where(dead, torch.zeros_like(m), m)
    neg_inf = torch.full_like(m, float("-inf"))

    xs, order = x.sort(1, descending=True)
    k = top_k.long()
    use_k = (k > 0) & (k < vocab)
    kth = xs.gather(1, (k.clamp(1, vocab) - 1)[:, None]).squeeze(1)
    threshold = torch.where(use_k, kth, neg_inf)
    q = (torch.exp(x - m[:, None]) * WEIGHT_SCALE).long()  # floor: the values are >= 0
    q = torch.where(x >= threshold[:, None], q, 0)
    z = q.sum(1)

    with_min_p = torch.where(min_p > 0, m + torch.log(min_p), neg_inf)
    threshold = torch.maximum(threshold, with_min_p)

    # Top-p: the first position (in descending order) where the cumulative weight reaches
    # ceil(top_p * Z); its logit is the smallest kept. Weight before a token < top_p * Z <=>
    # < ceil(top_p * Z) (integers). Ties: every token of that logit has the same mass before it.
    target = torch.ceil(top_p.double() * z.double()).long()
    cum = q.gather(1, order).cumsum(1)
    j = torch.searchsorted(cum, target[:, None], side="left").squeeze(1)
    cut = xs.gather(1, j.clamp(max=vocab - 1)[:, None]).squeeze(1)
    use_p = (top_p < 1) & (j < vocab)
    threshold = torch.where(use_p, torch.maximum(threshold, cut), threshold)

    kept = torch.where(x >= threshold[:, None], q, 0)
    total = kept.sum(1)
    draw = torch.floor(u.to(device).double() * total.double()).long()
    draw = torch.minimum(draw, (total - 1).clamp(min=0))
    picked = torch.searchsorted(kept.cumsum(1), draw[:, None], side="right").squeeze(1)
    picked = torch.where(dead, torch.zeros_like(picked), picked.clamp(max=vocab - 1))
    return torch.where(greedy, greedy_ids, picked)
