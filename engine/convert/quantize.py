"""Quantize one linear layer to EXL3: incoherence processing, LDLQ, trellis encoding, packing.

Follows docs/EXL3_FORMAT.md section 9 (the reference converter's recipe), in the format's
orientation: ``W`` is ``(in, out)`` (the HF weight transposed) and the stored tensors satisfy
``W ~= diag(suh) . H_in . Q . H_out . diag(svh)`` (section 4).

1. Output side: per-column RMS scales (mean 1; zero columns -> 0.1 while scaling, ``svh = 0``
   at the end) times random signs -> ``sv``; ``W <- (W / sv) . H_out``.
2. Input side: per-row RMS of that times random signs -> ``su``; ``W <- H_in . diag(1/su) . W``
   leaves rows of unit RMS: incoherent, close to iid Gaussian.
3. Global scale ``a``: the target is ``a . W`` (``su <- su / a``). With a Hessian, ``a`` is the
   grid point whose LDLQ proxy error is lowest on a sample of columns (:func:`choose_scale_ldlq`):
   the error feedback inflates the strip targets, so the best scale under LDLQ sits well below
   the best scale for plain rounding at high K (0.6 vs 0.8 codebook std at K=6). Without one,
   sample tiles are test-quantized around the best scale for Gaussian data (:data:`GAUSSIAN_SCALE`).
4. LDLQ: 16-row strips from last to first, each strip's target corrected by the already
   quantized strips' error through the block-LDL factor of the rotated Hessian, then encoded
   tile by tile with the tail-biting Viterbi (:mod:`engine.convert.viterbi`).
5. Refit ``suh``/``svh`` to the chosen trellis by least squares in the layer's loss
   (:mod:`engine.convert.refit`; with a Hessian, ``refit=True``).
6. Pack the states (:func:`engine.exl3.trellis.pack_states`).

``suh``/``svh`` are rounded to fp16 *before* the target is formed, so the decoder sees exactly
the scales the target was computed with; step 5 then moves them to the best fit for the chosen
trellis and rounds them again (``proxy_error`` stays LDLQ's own, before the refit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.convert.ldl import block_ldl
from engine.convert.refit import RefitScales, refit_scales
from engine.convert.viterbi import encode_tiles
from engine.exl3.codebooks import FLAG_VALUES, INST3, codebook_table
from engine.exl3.hadamard import HADAMARD_SIZE, blockwise_hadamard, blockwise_hadamard_into
from engine.exl3.reconstruct import apply_scales, matrix_to_tiles, tiles_to_matrix
from engine.exl3.trellis import TILE, check_bits, pack_states

# Best input scale for unit-variance Gaussian data, in units of the codebook's standard
# deviation, per K (1..8); measured with ``python -m engine.convert.mse`` (all three codebooks are
# within a few per cent of each other).
GAUSSIAN_SCALE = {1: 1.05, 2: 1.0, 3: 0.95, 4: 0.9, 5: 0.85, 6: 0.8, 7: 0.75, 8: 0.7}

# The LDLQ-aware search (units of the codebook's std): one grid, wide enough for every K
# (ExLlamaV3's chosen scales span ~0.45-1.1 std), fine where high K lands, all candidates
# encoded in the same pass (on the GPU the pass costs its number of sequential Viterbi calls).
SCALE_GRID = (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0, 1.1, 1.2)
# The search runs LDLQ on this many sampled output columns and on the leading rows of the
# Hessian only (its leading block's LDL factor is the full factor's leading block, so this is an
# exact, smaller LDLQ problem); a fraction of the main pass's sequential Viterbi calls.
SEARCH_COLUMNS = 128
SEARCH_ROWS = 1024


@dataclass
class QuantizedTensors:
    """The stored tensors of one EXL3 linear plus what the converter reports about it."""

    trellis: torch.Tensor  # (in/16, out/16, 16K) int16
    suh: torch.Tensor  # (in,) fp16
    svh: torch.Tensor  # (out,) fp16
    codebook: str
    bits: int
    proxy_error: float  # tr(E^T H E) / tr(W^T H W) in the rotated basis
    scale: float  # the global scale a
    damping: float  # Hessian damping used (inf: no error feedback)
    refit: RefitScales | None = None  # the scale refit's loss before/after (None: not run)

    def tensors(self, prefix: str, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Named tensors in the reference layout (section 3.1): suh, svh, flag, trellis, bias."""
        out = {f"{prefix}.suh": self.suh, f"{prefix}.svh": self.svh}
        if self.codebook != INST3:
            out[f"{prefix}.{self.codebook}"] = torch.tensor(FLAG_VALUES[self.codebook], dtype=torch.int32)
        out[f"{prefix}.trellis"] = self.trellis
        if bias is not None:
            out[f"{prefix}.bias"] = bias.to(torch.float16)
        return out


def stored_tensor_count(codebook: str, bias: bool) -> int:
    """How many tensors :meth:`QuantizedTensors.tensors` stores for one linear."""
    return 3 + (codebook != INST3) + bias


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def fp16_scale(v: torch.Tensor) -> torch.Tensor:
    """Round a scale vector to fp16, keeping magnitudes inside fp16's normal range."""
    mag = v.abs().clamp(min=6.2e-5, max=6.0e4)
    return (torch.sign(v) * mag).to(torch.float16)


def _random_signs(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(device=device, dtype=torch.float32)


def ldlq_many(
    problems: Sequence[tuple[torch.Tensor, torch.Tensor | None]], k: int, table: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """LDLQ of independent problems ``(target (rows, cols), lower)`` at the same K, in lockstep:
    returns (states ``(rows/16, cols/16, 256)``, decoded) for each (:func:`ldlq_in_place` on
    copies of the targets, which are left as they are)."""
    work = [(target.clone(), lower) for target, lower in problems]
    states = ldlq_in_place(work, k, table)
    del work
    return [(st, decode_states(st, table)) for st in states]


def ldlq_in_place(
    problems: Sequence[tuple[torch.Tensor, torch.Tensor | None]], k: int, table: torch.Tensor
) -> list[torch.Tensor]:
    """LDLQ of independent problems ``(target (rows, cols), lower)`` at the same K, in lockstep;
    each target is overwritten with its error ``T - Q`` and the states ``(rows/16, cols/16,
    256)`` int32 are returned (:func:`decode_states` gives ``Q``).

    Last strip first; strip b's target is ``T_b + sum_{j>b} L_jb^T (T_j - Q_j)`` (``lower`` None:
    plain rounding, no feedback). The strips of one problem are sequential, but problems (and the
    columns within one) never interact, so each step encodes the current strip of every problem in
    one Viterbi call: a GPU runs a call's tiles side by side, and one small strip alone would leave
    it mostly idle. Tiles are encoded independently, so the result is the same as one at a time.

    The rows below the current strip are only ever read as ``T_j - Q_j``, so each strip's error
    replaces its target as soon as it is encoded: no decoded copy and no per-strip difference
    of the weight's size (an LM head's is 2.1 GB in float32).
    """
    states = [
        torch.zeros(t.shape[0] // TILE, t.shape[1] // TILE, 256, dtype=torch.int32, device=t.device)
        for t, _ in problems
    ]
    strips = [t.shape[0] // TILE for t, _ in problems]
    for step in range(max(strips, default=0)):
        tiles, where = [], []
        for i, (target, lower) in enumerate(problems):
            if step >= strips[i]:
                continue
            b = strips[i] - 1 - step
            r0, r1 = b * TILE, (b + 1) * TILE
            strip = target[r0:r1]
            if lower is not None and r1 < target.shape[0]:
                strip = strip + lower[r1:, r0:r1].t() @ target[r1:]  # rows r1.. hold T - Q
            tiles.append(matrix_to_tiles(strip)[0])  # (cols/16, 256) in storage order
            where.append((i, b))
        codes = encode_tiles(torch.cat(tiles), k, table)
        values = table[codes.long()].float()
        offset = 0
        for (i, b), part in zip(where, tiles):
            n = part.shape[0]
            states[i][b] = codes[offset : offset + n]
            decoded = tiles_to_matrix(values[offset : offset + n].unsqueeze(0))
            problems[i][0][b * TILE : (b + 1) * TILE].sub_(decoded)
            offset += n
    return states


# Tile rows per step of decode_states: its int64 indices are 8 bytes per weight.
DECODE_TILE_ROWS = 64


def decode_states(states: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The decoded matrix ``Q`` ``(rows, cols)`` float32 of LDLQ's states ``(rows/16, cols/16,
    256)``: ``table[state]`` laid out as :func:`ldlq_in_place` subtracted it, a few tile rows at a
    time."""
    a, b, _ = states.shape
    q = torch.empty(a * TILE, b * TILE, dtype=torch.float32, device=states.device)
    for a0 in range(0, a, DECODE_TILE_ROWS):
        part = states[a0 : a0 + DECODE_TILE_ROWS]
        q[a0 * TILE : (a0 + part.shape[0]) * TILE] = tiles_to_matrix(table[part.long()].float())
    return q


@dataclass
class _ScaleSearch:
    """The LDLQ problem of :func:`choose_scale_ldlq` and what picks the scale from its result."""

    target: torch.Tensor  # every candidate's scaled sample, side by side
    lower: torch.Tensor
    h: torch.Tensor
    per_col: torch.Tensor  # each column's candidate scale
    std: float  # the codebook's standard deviation (the grid's unit)

    def best(self, q: torch.Tensor) -> float:
        e = (self.target - q) / self.per_col  # the error in the unit-weight domain
        rows = self.target.shape[0]
        errors = ((self.h @ e) * e).reshape(rows, len(SCALE_GRID), -1).sum((0, 2))  # tr(E^T H E) per scale
        return SCALE_GRID[int(errors.argmin())] * self.std


def choose_scale_ldlq(
    unit: torch.Tensor,
    h_rot: torch.Tensor,
    lower: torch.Tensor,
    k: int,
    table: torch.Tensor,
    gen: torch.Generator | None = None,
) -> float:
    """Pick the global scale for rotated weights ``unit`` (rows ~unit RMS) by the quantity LDLQ
    minimises: the proxy error ``tr(E^T H E)`` after a full LDLQ pass at each candidate scale.

    Runs on :data:`SEARCH_COLUMNS` columns (whole tiles) and the leading
    :data:`SEARCH_ROWS` rows; all candidates go through the same Viterbi calls.
    """
    search = _scale_search(unit, h_rot, lower, table, gen)
    ((_, q),) = ldlq_many([(search.target, search.lower)], k, table)
    return search.best(q)


def _scale_search(
    unit: torch.Tensor,
    h_rot: torch.Tensor,
    lower: torch.Tensor,
    table: torch.Tensor,
    gen: torch.Generator | None,
) -> _ScaleSearch:
    """The sampled LDLQ problem of :func:`choose_scale_ldlq`, every candidate side by side."""
    std = float(table.float().std())
    n_rows, n_cols = unit.shape
    rows = min(n_rows, SEARCH_ROWS)
    tile_cols = n_cols // TILE
    take = min(tile_cols, SEARCH_COLUMNS // TILE)
    # Half the sample is the tile columns holding the largest magnitudes, half random ones. Past
    # the best scale the error does not grow smoothly: a few values driven out of the codebook's
    # range by the feedback start a runaway in their column, so the columns where that starts
    # must be in the sample or the search picks a scale that fails elsewhere.
    # Column blocks: |unit| whole is a head-sized temporary, and a max is exact in any grouping.
    step = max(TILE, PROXY_BLOCK // max(n_rows, 1) // TILE * TILE)
    col_peaks = torch.cat([unit[:, c0 : c0 + step].abs().amax(0) for c0 in range(0, n_cols, step)])
    peaks = col_peaks.reshape(tile_cols, TILE).amax(1).cpu()
    chosen = torch.zeros(tile_cols, dtype=torch.bool)
    chosen[peaks.topk(take // 2).indices] = True
    others = torch.randperm(tile_cols, generator=gen)
    chosen[others[~chosen[others]][: take - take // 2]] = True
    picked = chosen.nonzero().squeeze(1)
    cols = (picked[:, None] * TILE + torch.arange(TILE)).reshape(-1).to(unit.device)
    sample = unit[:rows].index_select(1, cols)
    h = h_rot[:rows, :rows].float()
    # Contiguous as the float64 slice's conversion was (``lower`` may be float32 already).
    lower_f = lower[:rows, :rows].float().contiguous()

    target = torch.cat([sample * (a * std) for a in SCALE_GRID], dim=1)
    per_col = torch.tensor(SCALE_GRID, device=unit.device).repeat_interleave(sample.shape[1]) * std
    return _ScaleSearch(target, lower_f, h, per_col, std)


def choose_scale(
    w: torch.Tensor, k: int, table: torch.Tensor, sample_tiles: int = 16, gen: torch.Generator | None = None
) -> float:
    """Pick the global scale for rotated weights ``w`` (rows ~unit RMS) by test-quantizing tiles."""
    std = float(table.float().std())
    prior = GAUSSIAN_SCALE[k] * std
    tiles = matrix_to_tiles(w).reshape(-1, 256)
    if tiles.shape[0] > sample_tiles:
        idx = torch.randperm(tiles.shape[0], generator=gen)[:sample_tiles].to(tiles.device)
        tiles = tiles[idx]
    best, best_err = prior, float("inf")
    for factor in (0.9, 1.0, 1.1):
        a = prior * factor
        states = encode_tiles(tiles * a, k, table)
        err = float(((table[states.long()].float() / a - tiles) ** 2).mean())
        if err < best_err:
            best, best_err = a, err
    return best


@dataclass
class Incoherent:
    """Steps 1-2 of :func:`quantize_weight`: the weight in the format's orientation, rotated."""

    w: torch.Tensor  # (n_in, n_out): the weight after the output side, (W / sv) . H_out
    sv: torch.Tensor  # (n_out,) fp16 output scales (signs times column RMS)
    su: torch.Tensor  # (n_in,) float32 input scales before the global scale (signs times row RMS)
    # (n_in, n_out): H_in . diag(1/su) . w, rows of unit RMS; quantize_weights drops it once the
    # scale is chosen (a head-sized copy that nothing after the scale search reads).
    unit: torch.Tensor | None
    dead: torch.Tensor  # (n_out,) bool: all-zero (or padding) output columns


def incoherence(
    weight: torch.Tensor, gen: torch.Generator, out_scales: bool, device: torch.device
) -> Incoherent:
    """Pad an HF weight ``(out, in)`` to multiples of 128, transpose it and apply the output-side
    then the input-side scales and Hadamards (steps 1-2; draws the sv signs, then the su signs)."""
    out_f, in_f = weight.shape
    n_in, n_out = _round_up(in_f, HADAMARD_SIZE), _round_up(out_f, HADAMARD_SIZE)
    w = torch.zeros(n_in, n_out, dtype=torch.float32, device=device)
    w[:in_f, :out_f].copy_(weight.t())  # converts on the way: no float32 copy of the weight beside w

    # 1. Output side.
    col_rms = w.pow(2).mean(dim=0).sqrt()
    dead = col_rms == 0
    if out_scales and (~dead).any():
        col_scale = col_rms / col_rms[~dead].mean()
        col_scale[dead] = 0.1
    else:
        col_scale = torch.ones_like(col_rms)
    sv = fp16_scale(_random_signs(n_out, gen, device) * col_scale)
    w = blockwise_hadamard(w.div_(sv.float().unsqueeze(0)), dim=1)  # w is ours: divided in place

    # 2. Input side (before the global scale).
    row_rms = w.pow(2).mean(dim=1).sqrt()
    row_rms = torch.where(row_rms > 0, row_rms, torch.ones_like(row_rms))
    su = _random_signs(n_in, gen, device) * row_rms
    unit = input_hadamard(w, su)
    return Incoherent(w, sv, su, unit, dead)


def input_hadamard(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blockwise_hadamard(w / scales.unsqueeze(1), dim=0)`` bit for bit, with one temporary of
    ``w``'s size instead of two: the division writes straight into the transposed staging copy
    that the transform along dim 0 makes anyway."""
    staging = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
    torch.div(w.t(), scales.unsqueeze(0), out=staging)
    out = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
    return blockwise_hadamard_into(staging.t(), 0, out)  # staging.t() along dim 0 is staging itself


def padded_hessian(hessian: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``hessian`` ``(in, in)`` in ``dtype`` on ``device``, zero-padded to the stored ``(n, n)``."""
    in_f = hessian.shape[0]
    h = torch.zeros(n, n, dtype=dtype, device=device)
    h[:in_f, :in_f].copy_(hessian)  # converts on the way: no converted copy beside h
    return h


def rotated_hessian(
    hessian: torch.Tensor,
    su: torch.Tensor,
    damping: float = 0.01,
    warn: Callable[[str], None] | None = None,
    lower_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The Hessian in Q's input basis and its block-LDL factor: ``(h, L, damping_used)``.

    Q's input is ``x' = (x * su') H_in`` with ``su' = su / a``, so ``H' = H_in diag(su') H
    diag(su') H_in``. The global scale only multiplies ``H'`` (``L`` and the relative proxy
    error do not change), so ``h`` is formed with ``su / max|su|``, before ``a`` is known, and
    serves the scale search and the LDLQ pass. ``h`` is float64, padded to ``len(su)``; ``L`` is
    computed in float64 and returned in ``lower_dtype``.

    ``H'`` is built in one float64 buffer of its own plus one staging buffer (the transform's
    transposed copy), scaled in place: the values of ``H_in (s H s) H_in`` as two
    :func:`blockwise_hadamard` calls give them, without their input and output copies.
    """
    h = padded_hessian(hessian, su.shape[0], torch.float64, su.device)
    s = su.double() / float(su.abs().max())
    h.mul_(s.unsqueeze(1)).mul_(s.unsqueeze(0))  # (s_i h_ij) s_j, as s.unsqueeze(1) * h * s.unsqueeze(0)
    staging = torch.empty_like(h)
    h = blockwise_hadamard_into(blockwise_hadamard_into(h, 0, h, staging), 1, h, staging)
    del staging
    lower, damp = block_ldl(h, damping, TILE, warn, dtype=lower_dtype)
    return h, lower, damp


@dataclass
class WeightJob:
    """One linear for :func:`quantize_weights`: an HF-orientation weight ``(out, in)``, its input
    second moment ``E[x^T x]`` ``(in, in)`` (None: plain rounding, no error feedback), K, the seed
    of its random signs, and where its warnings go."""

    weight: torch.Tensor
    hessian: torch.Tensor | None
    bits: int
    seed: int = 0
    warn: Callable[[str], None] | None = None


def quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    bits: int,
    codebook: str = "mul1",
    *,
    seed: int = 0,
    warn: Callable[[str], None] | None = None,
    **options,
) -> QuantizedTensors:
    """Quantize an HF-orientation weight ``(out, in)`` to EXL3 tensors at ``bits`` per weight: one
    :class:`WeightJob` through :func:`quantize_weights` (``options`` are its keyword options)."""
    return quantize_weights([WeightJob(weight, hessian, bits, seed, warn)], codebook, **options)[0]


@dataclass
class _InFlight:
    """A job between the steps of :func:`quantize_weights`."""

    job: WeightJob
    table: torch.Tensor
    inc: Incoherent
    h_rot: torch.Tensor | None  # the rotated Hessian (None: no usable Hessian)
    lower: torch.Tensor | None  # its block-LDL factor in float32 (what LDLQ multiplies by)
    damping: float
    scale: float = 0.0
    search: _ScaleSearch | None = None  # the LDLQ-aware scale search, while it is pending
    target: torch.Tensor | None = None  # the target T, then (after LDLQ) its error T - Q
    target_power: float = 0.0  # tr(T^T H T): the proxy error's denominator, taken before LDLQ
    suh: torch.Tensor | None = None
    states: torch.Tensor | None = None  # LDLQ's result, until _finish packs it


def _lockstep(items: list[_InFlight], problem: Callable, solve: Callable[..., list] = ldlq_many) -> list:
    """``solve`` (:func:`ldlq_many`, or :func:`ldlq_in_place`) over ``items`` grouped by K:
    ``problem(item)`` is its ``(target, lower)``; returns each item's result in order."""
    out: list = [None] * len(items)
    for k in sorted({item.job.bits for item in items}):
        picked = [i for i, item in enumerate(items) if item.job.bits == k]
        table = items[picked[0]].table
        for i, result in zip(picked, solve([problem(items[i]) for i in picked], k, table)):
            out[i] = result
    return out


def quantize_weights(
    jobs: Sequence[WeightJob],
    codebook: str = "mul1",
    *,
    out_scales: bool = True,
    damping: float = 0.01,
    search_scale: bool = True,
    refit: bool = True,
    device: torch.device | str | None = None,
) -> list[QuantizedTensors]:
    """Quantize several linears to EXL3 tensors (steps 1-6 of the module docstring for each).

    The LDLQ passes of jobs with the same K (the scale search's and the main one) run in lockstep
    (:func:`ldlq_many`); every job gets exactly what it would get alone. Stored dims are padded to
    multiples of 128 (section 3.3). ``refit``: step 5 (needs a usable Hessian).
    """
    flights = []
    for job in jobs:
        check_bits(job.bits)
        dev = torch.device(device) if device is not None else job.weight.device
        gen = torch.Generator().manual_seed(job.seed)
        table = codebook_table(codebook, dev)
        inc = incoherence(job.weight, gen, out_scales, dev)
        h_rot, lower, damp = None, None, float("inf")
        if job.hessian is not None:
            # L straight to float32: LDLQ multiplies in float32, and the float64 factor beside it
            # would be another Hessian-sized buffer held through the whole pass.
            h, lower, damp = rotated_hessian(job.hessian, inc.su, damping, job.warn, torch.float32)
            h_rot = h if damp != float("inf") else None
            del h
        flight = _InFlight(job, table, inc, h_rot, lower if h_rot is not None else None, damp)
        del h_rot, lower
        # 3. Global scale (the LDLQ-aware searches run below, together).
        if not search_scale:
            flight.scale = GAUSSIAN_SCALE[job.bits] * float(table.std())
        elif flight.h_rot is None:
            flight.scale = choose_scale(inc.unit, job.bits, table, gen=gen)
        else:
            flight.search = _scale_search(inc.unit, flight.h_rot, flight.lower, table, gen)
        inc.unit = None
        flights.append(flight)

    searching = [f for f in flights if f.search is not None]
    results = _lockstep(searching, lambda f: (f.search.target, f.search.lower))
    for f, (_, q) in zip(searching, results):
        f.scale, f.search = f.search.best(q), None

    # Fix su in fp16 and form the exact target for it; 4. LDLQ over the whole matrices, each
    # target turned into its error in place (the proxy error's denominator is taken first).
    for f in flights:
        f.suh = fp16_scale(f.inc.su / f.scale)
        f.target = input_hadamard(f.inc.w, f.suh.float())
        f.target_power = _proxy_terms(f.target, f.h_rot)
    states = _lockstep(flights, lambda f: (f.target, f.lower), ldlq_in_place)
    # The flights own their results (not a list beside them), so _finish can let each go early.
    for f in flights:
        f.states = states.pop(0)
    return [_finish(f, codebook, refit) for f in flights]


# Elements per float64 column block of the proxy error (256 MB), and tiles per packing step: a
# head's whole-matrix float64 copies (4.2 GB each for an 8B model's) and packing's K int32 bits
# per weight (12.6 GB at K=6) were its largest allocations on the device.
PROXY_BLOCK = 1 << 25
PACK_TILES = 1 << 16


def _proxy_terms(x: torch.Tensor, h_rot: torch.Tensor | None) -> float:
    """``tr(X^T H X)`` (``H`` None: the identity), summed over column blocks in float64.
    ``tr(X^T H X)`` is ``sum((H X) * X)``: never the (out x out) product (an LM head has out =
    vocab, which would be 128k x 128k)."""
    width = max(1, PROXY_BLOCK // max(x.shape[0], 1))
    total = 0.0
    for c0 in range(0, x.shape[1], width):
        part = x[:, c0 : c0 + width].double()
        total += float(((h_rot @ part) * part).sum()) if h_rot is not None else float(part.pow(2).sum())
    return total


def _proxy_ratio(error_power: float, target_power: float) -> float:
    """``tr(E^T H E) / tr(T^T H T)``, the relative proxy error (nan for an all-zero problem)."""
    if target_power == 0:
        return float("nan") if error_power == 0 else float("inf")
    return error_power / target_power


def _pack(states: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`pack_states` a bounded number of tiles at a time (each tile packs on its own)."""
    rows = max(1, PACK_TILES // max(states.shape[1], 1))
    return torch.cat([pack_states(states[r0 : r0 + rows], k) for r0 in range(0, states.shape[0], rows)])


def _finish(f: _InFlight, codebook: str, refit: bool) -> QuantizedTensors:
    """Proxy error, step 5 and packing for one job; lets go of its error and states (the decoded
    weight the refit needs is made from the states once they are packed) so that the refit runs
    with the fewest weight-sized buffers alive."""
    # Proxy error in the rotated basis (the loss LDLQ minimises), relative to the target's.
    proxy = _proxy_ratio(_proxy_terms(f.target, f.h_rot), f.target_power)
    usable = f.h_rot is not None
    # The rotated Hessian and its factor are done with: a down projection's are 2.5 GB that the
    # refit (which has its own n x n float64 system to solve) need not have beside it.
    f.target = f.h_rot = f.lower = None
    trellis = _pack(f.states, f.job.bits)
    q = decode_states(f.states, f.table) if refit and usable else None
    f.states = None

    suh, svh = f.suh, f.inc.sv.clone()
    fit = None
    if q is not None:
        decoded = [q]  # handed over: _refit transforms it in place
        del q
        suh, svh, fit = _refit(f.inc, f.job.hessian, suh, decoded)
    f.inc.w = None  # nothing reads the rotated weight past the refit
    svh[f.inc.dead] = 0  # padded / all-zero output columns give exactly zero outputs
    return QuantizedTensors(trellis, suh, svh, codebook, f.job.bits, proxy, f.scale, f.damping, fit)


def _refit(
    inc: Incoherent, hessian: torch.Tensor, suh: torch.Tensor, decoded: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, RefitScales]:
    """Step 5: ``(suh, svh, fit)`` refit to the decoded rotated weight ``Q`` (the one item of
    ``decoded``, taken out and overwritten), rounded to fp16.

    ``W_hat = diag(suh) H_in Q H_out diag(sv)`` is what the stored tensors decode to
    (:func:`~engine.exl3.reconstruct.apply_scales` in ``Q``'s own buffer). The padded weight is
    formed in place too, and ``inc.w`` is let go once it exists.
    """
    sv = inc.sv.float()
    original = blockwise_hadamard(inc.w, dim=1).mul_(sv)  # the padded weight, (in, out)
    inc.w = None
    q = decoded.pop()
    w_hat = apply_scales(q, suh, inc.sv, in_place=True)
    fit = refit_scales(original, w_hat, padded_hessian(hessian, q.shape[0], torch.float32, q.device))
    return fp16_scale(suh.float() * fit.rows), fp16_scale(sv * fit.cols), fit
