"""Greedy decoding's argmax kernel (ext/argmax.cu) gives torch.argmax's answer: the first maximum,
a NaN above every number, on rows of any length and stride."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.kernels.sampling import argmax_rows

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]


# cluster=True: rows of 8192 or more run on a cluster of blocks each (sm_90), narrower ones as
# with cluster=False (one block per row).
@pytest.mark.parametrize("cluster", [True, False])
@pytest.mark.parametrize("vocab", [1, 3, 8191, 8192, 32000, 128256, 151937])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_random_rows(vocab: int, rows: int, cluster: bool) -> None:
    x = torch.randn(rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(vocab + rows))
    assert torch.equal(kernels.extension().argmax_rows(x, cluster=cluster), x.argmax(dim=-1))


@pytest.mark.parametrize("cluster", [True, False])
@pytest.mark.parametrize("width", [4099, 40000, 40003])
def test_ties_nans_and_infinities_as_torch(width: int, cluster: bool) -> None:
    """At 40000 (float4 loads) and 40003 (single loads) the cases straddle the cluster's slices:
    ties, NaNs and the maximum in different blocks, the last element in the last block."""
    last = width - 1
    x = torch.zeros(8, width, device="cuda")
    x[0, [5, 900, last - 99]] = 3.0  # tied maxima: the first
    x[1] = -float("inf")  # every value -inf: index 0
    x[2, last - 7] = float("nan")  # a NaN beats +inf
    x[2, 10] = float("inf")
    x[3, [last, last // 2]] = float("nan")  # two NaNs: the first
    x[4] = float("nan")
    x[5, last] = 1.0  # the last element, outside any 16-byte vector
    x[6, 1] = -0.0  # -0 == 0: the first zero stays
    x[7, [last - 1, width // 2 + 1, width // 2 + 2]] = 2.0  # tied maxima in the second half only
    assert torch.equal(kernels.extension().argmax_rows(x, cluster=cluster), x.argmax(dim=-1))


def test_strided_and_unaligned_rows() -> None:
    base = torch.randn(4, 1001, device="cuda")
    for x in (base[:, :1000], base[:, 1:], base[::2]):  # row stride 1001 (odd), offset 1, every other row
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), x.shape
    wide = torch.randn(3, 50001, device="cuda")
    for x in (wide[:, :50000], wide[:, 1:], wide[::2]):  # the same on the cluster kernel
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), x.shape


def test_other_dtypes_are_left_to_torch() -> None:
    x = torch.randn(3, 500, device="cuda", dtype=torch.bfloat16)
    assert argmax_rows(x) is None  # the caller runs x.argmax(dim=-1)
