"""LFM2's gated short convolution (engine/modules/short_conv.py) against a reference written here:
the whole sequence at once, ``out(C * conv(B * x))`` with a zero-padded causal ``F.conv1d``.

The module must give the same rows when a sequence arrives in pieces (its window carried in its
state slot), beside other sequences in one step, or one token per row in the fixed-shape decode
path; a sequence starting at position 0 ignores what its slot held before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cache.recurrent import RecurrentStateLayer
from engine.layers.short_conv import ShortConvSpec, conv_window
from engine.modules.batch import BatchLayout, DecodeTables, SequenceSlice
from engine.modules.causal_conv import CausalConv1d
from engine.modules.linear import DenseLinear
from engine.modules.short_conv import ShortConv

HIDDEN, KERNEL = 8, 3


@pytest.fixture(scope="module")
def conv() -> ShortConv:
    gen = torch.Generator().manual_seed(0)
    in_proj = DenseLinear(torch.randn(3 * HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
    weight, bias = torch.randn(HIDDEN, KERNEL, generator=gen), torch.randn(HIDDEN, generator=gen)
    out_proj = DenseLinear(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
    return ShortConv(in_proj, CausalConv1d(weight, bias), out_proj)


def reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """One whole sequence ``[T, hidden]``, as transformers' Lfm2ShortConv computes it without a
    cache: a depthwise convolution padded by ``K - 1`` zeros on the left."""
    b, c, v = (x @ conv.in_proj.weight.T).chunk(3, dim=-1)
    bx = (b * v).T[None]  # [1, hidden, T]
    weight = conv.conv.weight[:, None, :]
    y = F.conv1d(F.pad(bx, (KERNEL - 1, 0)), weight, conv.conv.bias, groups=HIDDEN)[0].T
    return (c * y) @ conv.out_proj.weight.T


def _state(slots: int) -> RecurrentStateLayer:
    return RecurrentStateLayer(conv_window(ShortConvSpec(HIDDEN, KERNEL)), slots, torch.float32, "cpu")


def _mixed_step(conv, state, pieces: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """One mixed step over ``(rows, past, slot)`` pieces of several sequences."""
    sequences, positions, start = [], [], 0
    for rows, past, slot in pieces:
        n = rows.shape[0]
        sequences.append(SequenceSlice(start, n, past, torch.empty(0), state_slot=slot))
        positions.append(torch.arange(past, past + n))
        start += n
    batch = BatchLayout(sequences, torch.cat(positions), torch.empty(0, dtype=torch.long))
    y = conv(torch.cat([rows for rows, _, _ in pieces]), batch, state)
    return list(y.split([rows.shape[0] for rows, _, _ in pieces]))


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, HIDDEN, generator=gen) for n in (11, 4, 7)]


def test_the_layer_declares_its_window():
    assert conv_window(ShortConvSpec(HIDDEN, KERNEL)).shapes == {"conv": (HIDDEN, KERNEL - 1)}


def test_a_whole_sequence_matches_the_reference(conv):
    (x,) = _sequences()[:1]
    (y,) = _mixed_step(conv, _state(1), [(x, 0, 0)])
    torch.testing.assert_close(y, reference(conv, x), rtol=1e-5, atol=1e-6)


def test_sequences_in_pieces_beside_each_other_match_each_alone(conv):
    """Three sequences in shared mixed steps, each split into pieces of 1 to 4 rows (shorter
    than the window too), in slots that do not follow their order."""
    seqs, slots = _sequences(), [2, 0, 1]
    state = _state(3)
    state["conv"].fill_(7.0)  # stale windows of earlier sequences: position 0 must ignore them
    done, got = [0, 0, 0], [[], [], []]
    sizes = iter([4, 1, 3, 1, 2, 4, 1, 3, 2, 1, 4, 2, 3, 1])
    while any(d < len(s) for d, s in zip(done, seqs)):
        pieces, owners = [], []
        for i, seq in enumerate(seqs):
            if done[i] < len(seq):
                n = min(next(sizes, 1), len(seq) - done[i])
                pieces.append((seq[done[i] : done[i] + n], done[i], slots[i]))
                owners.append(i)
                done[i] += n
        for i, y in zip(owners, _mixed_step(conv, state, pieces)):
            got[i].append(y)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(torch.cat(got[i]), reference(conv, seq), rtol=1e-5, atol=1e-6)
        # The slot holds the last K - 1 values of B * x, oldest first.
        b, _, v = (seq @ conv.in_proj.weight.T).chunk(3, dim=-1)
        torch.testing.assert_close(state["conv"][slots[i]], (b * v)[-(KERNEL - 1) :].T)
    assert (state["conv"][3] == 7.0).all()  # the scratch row was never touched


def test_the_fixed_shape_decode_path_matches_row_by_row(conv):
    """Prefill three sequences, then decode steps with one row each through the decode tables,
    a padding row on the scratch slot: each row equals the reference's row at that position."""
    seqs = _sequences()
    state = _state(3)
    _mixed_step(conv, state, [(s[:-3], 0, i) for i, s in enumerate(seqs)])
    for step in (3, 2, 1):
        rows = torch.cat([s[-step : len(s) - step + 1] for s in seqs] + [torch.randn(1, HIDDEN)])
        positions = torch.tensor([len(s) - step for s in seqs] + [0])
        tables = DecodeTables(
            torch.empty(0), torch.empty(0), 16, torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        )
        y = conv(rows, BatchLayout([], positions, torch.empty(0), decode=tables), state)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(y[i], reference(conv, s)[len(s) - step], rtol=1e-5, atol=1e-6)
    # A row at position 0 (here: the padding row, on the scratch slot) starts from zeros.
    torch.testing.assert_close(y[3], reference(conv, rows[3:4])[0], rtol=1e-5, atol=1e-6)
