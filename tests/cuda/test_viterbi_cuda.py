"""The CUDA tail-biting Viterbi (ext/viterbi.cu) against the torch path (engine.convert.viterbi)."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.convert.quantize import GAUSSIAN_SCALE
from engine.convert.viterbi import codebook_of_table, encode_tiles
from engine.exl3.codebooks import CODEBOOKS, codebook_table
from engine.exl3.trellis import pack_states, unpack_states
from engine.kernels.loader import CODEBOOK_IDS
from engine.kernels.viterbi import viterbi_encode

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]

KERNEL_K = range(1, 9)
REL = 1e-5


def _tiles(n: int, k: int, codebook: str, kind: str, seed: int) -> torch.Tensor:
    """Tiles at the converter's scale: Gaussian (what incoherence processing produces) or uniform."""
    g = torch.Generator().manual_seed(seed)
    std = float(codebook_table(codebook).float().std())
    if kind == "gauss":
        x = torch.randn(n, 256, generator=g) * GAUSSIAN_SCALE[k] * std
    else:
        x = (torch.rand(n, 256, generator=g) * 2 - 1) * 2 * std
    return x.cuda()


def _sq_err(states: torch.Tensor, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Per-tile squared error in float64."""
    return (table[states.long()].double() - x.double()).pow(2).sum(dim=1)


def _assert_tail_biting(states: torch.Tensor, k: int) -> None:
    # s_i = ((s_{i-1} << K) | c_i) & 0xFFFF, cyclically (s_{-1} = s_255).
    s = states.long()
    prev = torch.roll(s, 1, dims=1)
    assert torch.equal(((prev << k) | (s & ((1 << k) - 1))) & 0xFFFF, s)
    assert torch.equal(unpack_states(pack_states(states, k)).long(), s)


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", KERNEL_K)
@pytest.mark.parametrize("kind", ["gauss", "uniform"])
def test_matches_torch_path(k: int, codebook: str, kind: str) -> None:
    table = codebook_table(codebook, "cuda")
    x = _tiles(24, k, codebook, kind, seed=k * 31 + len(codebook))
    got = viterbi_encode(x, k, codebook)
    assert got is not None and got.dtype == torch.int32 and got.shape == x.shape
    ref = encode_tiles(x, k, table, use_kernel=False)
    _assert_tail_biting(got, k)
    e_got, e_ref = _sq_err(got, x, table), _sq_err(ref, x, table)
    same = (got == ref).all(dim=1)
    # Identical paths, or (a tie broken the other way) the same squared error.
    close = (e_got - e_ref).abs() <= REL * e_ref.clamp(min=1e-12)
    assert bool((same | close).all()), f"{int((~(same | close)).sum())} tiles differ in error"
    # The round-trip MSE equals the torch path's.
    assert abs(float(e_got.sum() - e_ref.sum())) <= REL * float(e_ref.sum())
    # Exact agreement is the rule (same float operations, same first-index ties).
    assert float(same.float().mean()) >= 0.9


def test_encode_tiles_uses_kernel_on_cuda() -> None:
    table = codebook_table("mul1", "cuda")
    x = _tiles(5, 4, "mul1", "gauss", seed=3)
    assert torch.equal(encode_tiles(x, 4, table), viterbi_encode(x, 4, "mul1"))


def test_chunked_workspace_gives_same_states() -> None:
    """Tiles run in several launches when the workspace is small: same answer."""
    x = _tiles(7, 3, "mcg", "gauss", seed=5)
    whole = kernels.extension().viterbi_encode(x, 3, CODEBOOK_IDS["mcg"], 1 << 30)
    per_tile = 255 << 13
    chunked = kernels.extension().viterbi_encode(x, 3, CODEBOOK_IDS["mcg"], 2 * per_tile)
    assert torch.equal(whole, chunked)


def test_k1_in_place_buffer_over_many_launches() -> None:
    """K=1 updates its one 128 KB cost buffer in place; its 8 MB of back-pointers per tile make
    the tiles run in several launches when the workspace is small: same states either way."""
    x = _tiles(6, 1, "mul1", "gauss", seed=9)
    whole = kernels.extension().viterbi_encode(x, 1, CODEBOOK_IDS["mul1"], 1 << 30)
    chunked = kernels.extension().viterbi_encode(x, 1, CODEBOOK_IDS["mul1"], 2 * (255 << 15))
    assert torch.equal(whole, chunked)
    _assert_tail_biting(whole, 1)


def test_not_applicable_falls_back() -> None:
    table = codebook_table("3inst", "cuda")
    x = _tiles(3, 1, "3inst", "gauss", seed=1)
    other = table.clone()
    other[0] = 123.0  # not a codebook
    assert codebook_of_table(other) is None  # encode_tiles then runs the torch path
    assert viterbi_encode(x.cpu(), 4, "3inst") is None
    assert viterbi_encode(x, 4, "no such codebook") is None
    # A copy of a codebook table (not the cached tensor) is recognised by value.
    assert codebook_of_table(table.clone()) == "3inst" and codebook_of_table(table) == "3inst"
    assert viterbi_encode(_tiles(2, 4, "3inst", "gauss", seed=2), 4, "3inst") is not None
