"""Codebooks (docs/EXL3_FORMAT.md section 6.2) against the spec's worked examples and the fixture tables."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import fp16_bits

from engine.exl3.codebooks import (
    CODEBOOKS,
    FLAG_VALUES,
    codebook_from_flags,
    codebook_table,
    decode_3inst,
    decode_mcg,
    decode_mul1,
    decode_states,
    round_to_fp16,
)

# (state, codebook) -> value, from sections 5.1 and 6.4 of the spec.
WORKED = [
    (0x4E52, "3inst", -0.6826171875),
    (0x4E52, "mcg", -0.07470703125),
    (0x4E52, "mul1", 0.1876220703125),
    (0x1234, "3inst", -2.19921875),
    (0x1234, "mcg", 1.5146484375),
    (0x1234, "mul1", -0.5771484375),
    (0x0000, "3inst", 0.76806640625),
    (0x0000, "mcg", 1.84375),
    (0x0000, "mul1", -3.453125),
    (0xFFFF, "3inst", -0.158203125),
    (0xFFFF, "mcg", 0.85009765625),
    (0xFFFF, "mul1", -0.6513671875),
]


@pytest.mark.parametrize(("state", "codebook", "value"), WORKED)
def test_worked_examples(state: int, codebook: str, value: float) -> None:
    got = decode_states(torch.tensor([state]), codebook)
    assert got.dtype == torch.float16
    assert got.item() == value


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_tables_bit_exact_vs_reference(ref, codebook: str) -> None:
    expected = ref("codebook_tables")[codebook]
    ours = codebook_table(codebook)
    assert ours.shape == expected.shape == (65536,)
    mismatches = (fp16_bits(ours) != fp16_bits(expected)).sum().item()
    assert mismatches == 0


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_table_statistics(codebook: str) -> None:
    # Section 6.2 statistics: a different table would show up here even without fixtures.
    t = codebook_table(codebook).double()
    std = {"3inst": 1.2437, "mcg": 1.2441, "mul1": 1.0003}[codebook]
    assert abs(t.std().item() - std) < 5e-4
    assert torch.isfinite(t).all()


def test_decode_accepts_signed_int16_states() -> None:
    # States read from int16 storage are negative above 0x7FFF; they must decode as uint16.
    signed = torch.tensor([0xCE52 - 0x10000, -1], dtype=torch.int16)
    unsigned = torch.tensor([0xCE52, 0xFFFF], dtype=torch.int32)
    assert torch.equal(fp16_bits(decode_states(signed, "mcg")), fp16_bits(decode_states(unsigned, "mcg")))


def test_round_to_fp16_single_rounding() -> None:
    # 1 + 2**-11 + 2**-40 is just above the midpoint between fp16 1.0 and 1.0009765625; rounding
    # via float32 first would drop the 2**-40 and tie to even (1.0). One rounding gives the upper.
    v = torch.tensor([1 + 2**-11 + 2**-40, 1 + 2**-11, -(2**-25) * 3, 65504.0], dtype=torch.float64)
    got = round_to_fp16(v)
    assert got.tolist() == [1.0009765625, 1.0, -(2**-23), 65504.0]


def test_codebook_from_flags() -> None:
    assert codebook_from_flags(True, False) == "mcg"
    assert codebook_from_flags(False, True) == "mul1"
    assert codebook_from_flags(False, False) == "3inst"
    with pytest.raises(ValueError):
        codebook_from_flags(True, True)
    assert FLAG_VALUES == {"mcg": -877912083, "mul1": -2082680531}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_cuda_decode_matches_cpu(codebook: str) -> None:
    # The formulas themselves (not the cached table) evaluated on the GPU.
    fn = {"3inst": decode_3inst, "mcg": decode_mcg, "mul1": decode_mul1}[codebook]
    states = torch.arange(65536)
    cpu = codebook_table(codebook)
    gpu = fn(states.cuda()).cpu()
    assert torch.equal(fp16_bits(cpu), fp16_bits(gpu))


def test_a_table_first_asked_for_in_inference_mode_is_an_ordinary_tensor():
    """The cache outlives the mode of its first caller: the converter reads the table's version
    (engine.convert.viterbi.codebook_of_table) outside inference mode."""
    from engine.convert.viterbi import codebook_of_table
    from engine.exl3 import codebooks

    codebooks._cpu_table.cache_clear()
    codebooks._device_table.cache_clear()
    with torch.inference_mode():
        table = codebooks.codebook_table("mcg", "cpu")
    assert not table.is_inference()
    assert codebook_of_table(table) == "mcg"
