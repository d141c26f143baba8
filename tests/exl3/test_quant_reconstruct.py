"""Tile layout, tile decode, Hadamard and scales (docs/EXL3_FORMAT.md sections 4, 6, 7) vs fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_helpers import VARIANTS, fp16_bits, rel_fro

from engine.exl3 import is_exl3_linear
from engine.exl3.codebooks import CODEBOOKS, codebook_from_flags
from engine.exl3.hadamard import blockwise_hadamard, hadamard_matrix
from engine.exl3.reconstruct import (
    apply_scales,
    decode_trellis,
    expand_sign_bits,
    matrix_to_tiles,
    storage_to_tile_index,
    tile_to_storage_index,
    tiles_to_matrix,
)

# Fixture README section 3 bounds for W (vs ExLlamaV3's get_weight_tensor).
W_REL_FRO = 1e-3
W_MAX_ABS_FRAC = 2e-3


def test_layout_tables_match_spec() -> None:
    a = storage_to_tile_index().tolist()
    # First rows of Table A and a few entries of Table B (section 6.1).
    assert a[:16] == [0, 16, 128, 144, 8, 24, 136, 152, 32, 48, 160, 176, 40, 56, 168, 184]
    assert a[240:] == [71, 87, 199, 215, 79, 95, 207, 223, 103, 119, 231, 247, 111, 127, 239, 255]
    b = tile_to_storage_index().reshape(16, 16)
    assert b[0].tolist()[:9] == [0, 32, 64, 96, 128, 160, 192, 224, 4]
    assert b[15, 15].item() == 255 and b[8, 0].item() == 2 and b[2, 0].item() == 8
    assert sorted(a) == list(range(256))


def test_tiles_matrix_round_trip() -> None:
    m = torch.randn(48, 32)
    assert torch.equal(tiles_to_matrix(matrix_to_tiles(m)), m)


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", range(1, 9))
def test_tile_decode_bit_exact(ref, codebook: str, k: int) -> None:
    q = decode_trellis(ref("trellis_inputs")[f"K{k}.trellis"], codebook)
    expected = ref(f"trellis_decode_{codebook}")[f"K{k}.q"]
    assert q.shape == expected.shape == (128, 256)
    assert torch.equal(fp16_bits(q), fp16_bits(expected))


def test_worked_example_q00(ref) -> None:
    trellis = ref("trellis_inputs")["K4.trellis"]
    values = {"3inst": -0.6826171875, "mcg": -0.07470703125, "mul1": 0.1876220703125}
    for codebook, value in values.items():
        assert decode_trellis(trellis, codebook)[0, 0].item() == value


def test_hadamard_matrix_properties() -> None:
    h = hadamard_matrix(128, torch.float64)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    # Sylvester order: H[i, j] = (-1)^popcount(i & j) / sqrt(128); spot-check a few entries.
    s = 128**0.5
    assert h[0, 5].item() * s == 1.0 and h[3, 1].item() * s == -1.0 and h[7, 7].item() * s == -1.0
    assert h[127, 127].item() * s == -1.0 and h[64, 63].item() * s == 1.0


def test_blockwise_hadamard_matches_butterfly() -> None:
    x = torch.randn(3, 256, dtype=torch.float64)
    # Independent reference: the 7-stage butterfly of section 7, per 128-block.
    y = x.reshape(3, 2, 128).clone()
    h = 1
    while h < 128:
        y = y.reshape(3, 2, 128 // (2 * h), 2, h)
        a, b = y[..., 0, :].clone(), y[..., 1, :].clone()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        h *= 2
    y = y.reshape(3, 256) / 128**0.5
    assert torch.allclose(blockwise_hadamard(x), y, atol=1e-12)
    # Along dim 0 it is the transpose of along dim 1.
    assert torch.allclose(blockwise_hadamard(x.T, dim=0), y.T, atol=1e-12)
    with pytest.raises(ValueError):
        blockwise_hadamard(torch.zeros(2, 100))


def _check_w(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape
    assert rel_fro(ours, expected) <= W_REL_FRO
    max_abs = (ours.double() - expected.double()).abs().max().item()
    assert max_abs <= W_MAX_ABS_FRAC * expected.abs().max().item()


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", [2, 4, 6])
def test_scales_and_hadamard_vs_reference(ref, codebook: str, k: int) -> None:
    inputs, decoded = ref("trellis_inputs"), ref(f"trellis_decode_{codebook}")
    q = decode_trellis(inputs[f"K{k}.trellis"], codebook)
    ones_in, ones_out = torch.ones(128, dtype=torch.float16), torch.ones(256, dtype=torch.float16)
    _check_w(apply_scales(q, ones_in, ones_out), decoded[f"K{k}.w_unit"])
    w = apply_scales(q, inputs[f"K{k}.suh"], inputs[f"K{k}.svh"])
    _check_w(w, decoded[f"K{k}.w"])
    # Our float32 path against our exact float64 path: far tighter than fp16 rounding.
    exact = apply_scales(q, inputs[f"K{k}.suh"], inputs[f"K{k}.svh"], torch.float64)
    assert rel_fro(w, exact) < 1e-6


def test_suh_before_input_hadamard(ref) -> None:
    # Swapping the order of suh and H_in (a classic mistake) must break the match.
    inputs, decoded = ref("trellis_inputs"), ref("trellis_decode_mcg")
    q = decode_trellis(inputs["K4.trellis"], "mcg").double()
    suh, svh = inputs["K4.suh"].double(), inputs["K4.svh"].double()
    wrong = blockwise_hadamard(blockwise_hadamard(suh[:, None] * q, dim=0), dim=1) * svh
    assert rel_fro(wrong, decoded["K4.w"]) > 0.1


def test_expand_sign_bits() -> None:
    packed = torch.tensor([0b1000_0000_0000_0101, 0], dtype=torch.int32).to(torch.int16)
    v = expand_sign_bits(packed)
    assert v.dtype == torch.float16 and v.shape == (32,)
    expected = [1.0] * 32
    expected[0] = expected[2] = expected[15] = -1.0
    assert v.tolist() == expected


def _model_linears(model_dir: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    keys = set(tensors)
    prefixes = sorted(k[: -len(".trellis")] for k in keys if k.endswith(".trellis"))
    assert prefixes and all(is_exl3_linear(keys, p) for p in prefixes)
    return tensors, prefixes


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_model_q_bit_exact(exl3_dir: Path, ref, variant: str) -> None:
    tensors, prefixes = _model_linears(exl3_dir / f"tiny-llama-exl3-{variant}")
    expected = ref(f"reconstructed_{variant}")
    assert len(prefixes) == 15  # 7 linears x 2 layers + lm_head
    compared = 0
    for prefix in prefixes:
        cb = codebook_from_flags(f"{prefix}.mcg" in tensors, f"{prefix}.mul1" in tensors)
        assert cb == variant.rsplit("-", 1)[1]
        q = decode_trellis(tensors[f"{prefix}.trellis"], cb)
        if f"{prefix}.q" not in expected:
            assert prefix == "lm_head"  # left out of the smaller fixtures to save space
            continue
        assert torch.equal(fp16_bits(q), fp16_bits(expected[f"{prefix}.q"])), prefix
        compared += 1
    assert compared == (15 if variant.startswith("4.0") else 14)


def test_converted_model_w_within_bounds(exl3_dir: Path, ref) -> None:
    variant = "4.0bpw-h6-mul1"
    tensors, prefixes = _model_linears(exl3_dir / f"tiny-llama-exl3-{variant}")
    expected = ref(f"reconstructed_{variant}")
    for prefix in prefixes:
        q = decode_trellis(tensors[f"{prefix}.trellis"], "mul1")
        w = apply_scales(q, tensors[f"{prefix}.suh"], tensors[f"{prefix}.svh"])
        _check_w(w, expected[f"{prefix}.w"])
