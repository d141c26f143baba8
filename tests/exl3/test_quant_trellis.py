"""Trellis state extraction and packing (docs/EXL3_FORMAT.md section 5) against the fixtures."""

from __future__ import annotations

import pytest
import torch

from engine.exl3.trellis import bits_of_trellis, pack_states, unpack_states

KS = range(1, 9)


def test_worked_example_k4(ref) -> None:
    # Section 5.1: K4.trellis[0, 0].
    tile = ref("trellis_inputs")["K4.trellis"][0, 0]
    w = tile.to(torch.int32) & 0xFFFF
    assert (w[0].item(), w[1].item(), w[62].item(), w[63].item()) == (0x3C02, 0x2A0B, 0x74E5, 0xD089)
    s = unpack_states(tile).tolist()
    assert (s[0], s[1], s[3], s[5], s[255]) == (0x4E52, 0xE52A, 0x2A0B, 0x0B3C, 0x74E5)


def test_worked_example_k3(ref) -> None:
    tile = ref("trellis_inputs")["K3.trellis"][0, 0]
    assert unpack_states(tile)[5].item() == 0xB575


@pytest.mark.parametrize("k", KS)
def test_states_bit_exact(ref, k: int) -> None:
    inputs = ref("trellis_inputs")
    trellis = inputs[f"K{k}.trellis"]
    expected = inputs[f"K{k}.states"].to(torch.int32) & 0xFFFF
    states = unpack_states(trellis)
    assert states.shape == expected.shape == (8, 16, 256)
    assert torch.equal(states, expected)


@pytest.mark.parametrize("k", KS)
def test_pack_round_trip_bit_exact(ref, k: int) -> None:
    inputs = ref("trellis_inputs")
    packed = pack_states(inputs[f"K{k}.states"], k)
    assert packed.dtype == torch.int16
    assert torch.equal(packed, inputs[f"K{k}.trellis"])


@pytest.mark.parametrize("k", KS)
def test_states_obey_bitshift_recurrence(k: int) -> None:
    # state(i) = ((state(i-1) << K) | code(i)) & 0xFFFF, circularly (tail-biting): every random
    # word pattern is a valid tile.
    g = torch.Generator().manual_seed(k)
    trellis = torch.randint(-(2**15), 2**15, (3, 5, 16 * k), dtype=torch.int16, generator=g)
    s = unpack_states(trellis)
    prev = torch.roll(s, 1, dims=-1)
    mask = (1 << k) - 1
    assert torch.equal((prev << k | (s & mask)) & 0xFFFF, s)
    assert torch.equal(pack_states(s, k), trellis)


def test_bits_of_trellis_rejects_bad_shapes() -> None:
    assert bits_of_trellis(torch.zeros(1, 1, 48, dtype=torch.int16)) == 3
    with pytest.raises(ValueError):
        bits_of_trellis(torch.zeros(1, 1, 40, dtype=torch.int16))
    with pytest.raises(ValueError):
        bits_of_trellis(torch.zeros(1, 1, 144, dtype=torch.int16))
    with pytest.raises(ValueError):
        pack_states(torch.zeros(1, 255, dtype=torch.int32), 4)
