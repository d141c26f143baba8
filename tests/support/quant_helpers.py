"""Helpers shared by the EXL3 format and converter tests (tests/exl3, tests/convert and the
architectures' conversion tests), imported as ``quant_helpers`` through the tests/support path
entry that tests/conftest.py adds. The fixture lookup itself is in tests/conftest.py."""

from __future__ import annotations

import torch

from engine.exl3.trellis import pack_states, unpack_states

VARIANTS = ("4.0bpw-h6-mul1", "2.5bpw-h4-mcg", "5.5bpw-h8-3inst")


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns, for bit-exact comparisons (treats -0.0 and 0.0 as different, NaNs equal)."""
    return x.to(torch.float16).view(torch.int16)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (both taken as float64)."""
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def cheap_encoder(x: torch.Tensor, k: int, table: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """A fast, valid, low-quality stand-in for the Viterbi (``quantize.encode_tiles``): greedy
    along the trellis (best next code for each value), made tail-biting by pack -> unpack (which
    only changes the first few states)."""
    values = table.float()
    codes = torch.arange(1 << k, device=x.device)
    state = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    for i in range(x.shape[1]):
        cand = ((state.unsqueeze(1) << k) | codes) & 0xFFFF
        best = (values[cand] - x[:, i : i + 1]).abs().argmin(dim=1)
        state = cand.gather(1, best.unsqueeze(1)).squeeze(1)
        out[:, i] = state.to(torch.int32)
    return unpack_states(pack_states(out, k))


def tiny_convert_options(**changes):
    """Converter options for a tiny test model on the CPU: a few short calibration rows of random
    tokens (tiny checkpoints have no tokenizer), uniform bits (6 by default, head 8); ``changes``
    override any of them."""
    from engine.convert.options import ConvertOptions

    settings = {
        "bits": 6.0,
        "head_bits": 8,
        "cal_rows": 4,
        "cal_cols": 32,
        "device": "cpu",
        "allocation": "uniform",
        "random_rows_fraction": 1.0,
    }
    return ConvertOptions(**{**settings, **changes})


def beam_encoder(
    x: torch.Tensor, k: int, table: torch.Tensor, batch: int | None = None, beams: int = 4
) -> torch.Tensor:
    """A stand-in for the Viterbi (``quantize.encode_tiles``) close enough at high K for 8-bit
    conversions: a beam search along the trellis, tail-biting as the Viterbi is. (The greedy
    :func:`cheap_encoder` lets pack -> unpack overwrite the first states, which leaves one value
    in 256 at random: at K = 8 that one value is most of a tile's error, ~9% of its norm.)

    A first greedy pass over the tile rotated by half (the wrap-around point mid-sequence)
    chooses the stream's last ``16 - K`` bits; the beam search then starts from them, and its
    last few codes are chosen together, among those that end the stream on them. At K = 8 on a
    random matrix: relative MSE 5.7e-5 with 4 beams, 2.3e-4 with one (greedy), 9.6e-3 for
    :func:`cheap_encoder`; about 4x the greedy's time."""
    values = table.float()
    n, half, overlap_bits = x.shape[1], x.shape[1] // 2, 16 - k
    start = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    greedy, _, _ = _beam_search(torch.roll(x, -half, dims=1), k, values, start, beams=1)
    overlap = greedy[half - 1][:, 0] & ((1 << overlap_bits) - 1)  # the state of value n - 1
    forced = -(-overlap_bits // k)  # the codes at the stream's end that hold those bits
    t0 = n - forced - 1
    states, parents, cost = _beam_search(x[:, :t0], k, values, overlap, beams)
    # The tail (codes t0..n-1, the first in the top bits) ends with the overlap; every choice of
    # its other bits is scored over the values it decides, after each beam.
    free = k * (forced + 1) - overlap_bits
    tails = ((torch.arange(1 << free, device=x.device) << overlap_bits) | overlap[:, None]).unsqueeze(1)
    last = states[-1].unsqueeze(2)
    tail_states = [
        ((last << (k * (j + 1))) | (tails >> (k * (forced - j)))) & 0xFFFF for j in range(forced + 1)
    ]
    error = cost.unsqueeze(2) + sum(
        (values[s] - x[:, t0 + j, None, None]) ** 2 for j, s in enumerate(tail_states)
    )
    best = error.flatten(1).argmin(dim=1, keepdim=True)
    head = _path(states, parents, best // error.shape[2])
    tail = torch.cat([s.flatten(1).gather(1, best) for s in tail_states], dim=1)
    out = torch.cat([head, tail], dim=1).to(torch.int32)
    return unpack_states(pack_states(out, k))  # already tail-biting: the round trip keeps it


def _beam_search(
    x: torch.Tensor, k: int, values: torch.Tensor, start: torch.Tensor, beams: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The ``beams`` best paths of states through tiles' values ``x`` ``(N, len)`` from the
    states ``start`` before them (only their low ``16 - k`` bits matter): per step the beams'
    states ``(N, b)`` and the beam each came from, and the final beams' squared errors."""
    # A state's successors are (low 16 - k bits) << k | code: row ``low`` of this table.
    successors = values.reshape(-1, 1 << k)
    low = (1 << (16 - k)) - 1
    state, cost = start.to(torch.int64)[:, None], torch.zeros(x.shape[0], 1, device=x.device)
    states, parents = [], []
    for i in range(x.shape[1]):
        prefix = state & low  # (N, b)
        total = (cost.unsqueeze(2) + (successors[prefix] - x[:, i, None, None]) ** 2).flatten(1)
        if beams == 1:
            cost, chosen = total.min(dim=1, keepdim=True)
        else:
            cost, chosen = total.topk(min(beams, total.shape[1]), dim=1, largest=False)
        parent = chosen >> k
        state = (prefix.gather(1, parent) << k) | (chosen & ((1 << k) - 1))
        states.append(state)
        parents.append(parent)
    return states, parents, cost


def _path(states: list[torch.Tensor], parents: list[torch.Tensor], beam: torch.Tensor) -> torch.Tensor:
    """The states ``(N, len)`` of the path that ends in beam ``beam`` ``(N, 1)``."""
    out = []
    for state, parent in zip(reversed(states), reversed(parents)):
        out.append(state.gather(1, beam))
        beam = parent.gather(1, beam)
    return torch.cat(out[::-1], dim=1)
