"""The pieces of the Mamba-2 mixer against references written here or in transformers: the scan's
chunked form (prefill) against its one-token step (decode) and a plain loop over the recurrence,
the gated norm against transformers' NemotronH one, and the mixer's fixed-shape decode path
against its mixed steps. (The causal convolution is tested with the gated delta net.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.modules.batch import BatchLayout, DecodeTables, SequenceSlice
from engine.modules.causal_conv import CausalConv1d
from engine.modules.linear import DenseLinear
from engine.modules.mamba2 import GatedGroupRMSNorm, Mamba2, ssd_chunked, ssd_step

HEADS, HEAD_DIM, GROUPS, D_STATE = 6, 4, 2, 8


def _scan_inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=g)
    dt = F.softplus(torch.randn(length, HEADS, generator=g) - 1.0)
    A = -torch.exp(torch.randn(HEADS, generator=g))
    B = torch.randn(length, GROUPS, D_STATE, generator=g)
    C = torch.randn(length, GROUPS, D_STATE, generator=g)
    state = torch.randn(HEADS, HEAD_DIM, D_STATE, generator=g)
    return x, dt, A, B, C, state


def _recurrence(x, dt, A, B, C, state):
    """The recurrence as written in the paper, one token and one head at a time (float64)."""
    x, dt, A, B, C, state = (t.double() for t in (x, dt, A, B, C, state))
    per_group = HEADS // GROUPS
    ys = torch.empty_like(x)
    for t in range(x.shape[0]):
        for h in range(HEADS):
            g = h // per_group
            state[h] = math.exp(dt[t, h] * A[h]) * state[h] + dt[t, h] * torch.outer(x[t, h], B[t, g])
            ys[t, h] = state[h] @ C[t, g]
    return ys, state


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_scan_is_the_recurrence_from_a_nonzero_state(chunk_size):
    """37 tokens in chunks that do (5, 16) and do not (1, 64) divide them, from a random state."""
    x, dt, A, B, C, state = _scan_inputs(37)
    want_y, want_state = _recurrence(x, dt, A, B, C, state.clone())
    y, after = ssd_chunked(x, dt, A, B, C, state, chunk_size)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.double(), want_state, rtol=1e-5, atol=1e-5)


def test_chunked_scan_and_step_agree_token_by_token_across_chunk_boundaries():
    """Two sequences (their own inputs and starting states, the layer's A) each scan a prompt of
    29 tokens in chunks of 8, ending mid-chunk, then step 6 tokens together: the outputs and the
    states are those of all 35 tokens scanned in chunks of 8, to float32 rounding."""
    (x1, dt1, A, B1, C1, s1), (x2, dt2, _, B2, C2, s2) = _scan_inputs(35, seed=1), _scan_inputs(35, seed=2)
    sequences = [(x1, dt1, B1, C1, s1), (x2, dt2, B2, C2, s2)]
    whole = [ssd_chunked(x, dt, A, B, C, s, 8) for x, dt, B, C, s in sequences]
    prompts = [ssd_chunked(x[:29], dt[:29], A, B[:29], C[:29], s, 8) for x, dt, B, C, s in sequences]
    states = torch.stack([state for _, state in prompts])
    for t in range(29, 35):
        x, dt, B, C = (torch.stack([seq[i][t] for seq in sequences]) for i in range(4))
        y, states = ssd_step(x, dt, A, B, C, states)
        torch.testing.assert_close(y, torch.stack([y_whole[t] for y_whole, _ in whole]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, torch.stack([state for _, state in whole]), rtol=1e-5, atol=1e-5)


def _conv(channels: int, kernel: int = 4, seed: int = 3) -> CausalConv1d:
    g = torch.Generator().manual_seed(seed)
    return CausalConv1d(
        torch.randn(channels, kernel, generator=g), torch.randn(channels, generator=g), "silu"
    )


def test_gated_norm_is_transformers_nemotron_h_one():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    g = torch.Generator().manual_seed(5)
    y, z, weight = (
        torch.randn(7, 24, generator=g),
        torch.randn(7, 24, generator=g),
        torch.randn(24, generator=g),
    )
    reference = NemotronHRMSNormGated(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        reference.weight.copy_(weight)
        want = reference(y, z)
    torch.testing.assert_close(GatedGroupRMSNorm(weight, 1e-5, 8)(y, z), want)


def _mixer(hidden=16) -> Mamba2:
    g = torch.Generator().manual_seed(6)
    inner, bc = HEADS * HEAD_DIM, GROUPS * D_STATE
    channels = inner + 2 * bc
    return Mamba2(
        DenseLinear(torch.randn(inner + channels + HEADS, hidden, generator=g) / 4),
        _conv(channels, seed=7),
        torch.randn(HEADS, generator=g),
        torch.randn(HEADS, generator=g),
        torch.randn(HEADS, generator=g),
        GatedGroupRMSNorm(1 + 0.1 * torch.randn(inner, generator=g), 1e-5, inner // GROUPS),
        DenseLinear(torch.randn(hidden, inner, generator=g) / 4),
        HEAD_DIM,
        GROUPS,
        D_STATE,
        chunk_size=4,
        dt_limit=(0.01, 0.5),
    )


def _state(slots: int) -> dict[str, torch.Tensor]:
    channels = HEADS * HEAD_DIM + 2 * GROUPS * D_STATE
    return {
        "conv": torch.zeros(slots + 1, channels, 3),
        "ssm": torch.zeros(slots + 1, HEADS, HEAD_DIM, D_STATE),
    }


def _mixed(sequences: list[tuple[int, int, int]]) -> BatchLayout:
    """(length, past, slot) per sequence, rows one after another."""
    slices, positions, row = [], [], 0
    for length, past, slot in sequences:
        slices.append(SequenceSlice(row, length, past, torch.empty(0), state_slot=slot))
        positions.append(torch.arange(past, past + length))
        row += length
    return BatchLayout(slices, torch.cat(positions), torch.empty(0))


def test_fixed_shape_decode_rows_follow_their_slots():
    """Two sequences prefilled in one mixed step, then decode steps in fixed shapes with a padding
    row on the scratch slot and a third sequence starting at position 0 (its slot holding another
    sequence's leftovers): each row is what mixed steps of that sequence alone give."""
    mixer = _mixer()
    x = torch.randn(3, 14, 16, generator=torch.Generator().manual_seed(8))
    lengths = (9, 5)
    state = _state(3)
    state["conv"][2].normal_()  # a finished sequence's leftovers in the third slot
    state["ssm"][2].normal_()
    with torch.no_grad():
        mixer(torch.cat([x[0, :9], x[1, :5]]), _mixed([(9, 0, 0), (5, 0, 1)]), state)
        got = []
        for step in range(3):
            past = [lengths[0] + step, lengths[1] + step, step]
            rows = torch.stack([x[0, past[0]], x[1, past[1]], x[2, past[2]], torch.zeros(16)])
            slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32)  # 3: the scratch slot
            decode = DecodeTables(torch.empty(0), torch.empty(0), 16, slots)
            batch = BatchLayout([], torch.tensor([*past, 0]), torch.empty(0), decode=decode)
            got.append(mixer(rows, batch, state)[:3])
        for s, start in enumerate((*lengths, 0)):
            alone = _state(1)
            if start:
                mixer(x[s, :start], _mixed([(start, 0, 0)]), alone)
            steps = [mixer(x[s, start + i][None], _mixed([(1, start + i, 0)]), alone) for i in range(3)]
            torch.testing.assert_close(
                torch.stack([g[s] for g in got]), torch.cat(steps), rtol=1e-5, atol=1e-5
            )
