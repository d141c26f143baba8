"""The int8 GEMV (ext/exl3_gemv_cluster.cuh, I8: MUL1 hash words as u8 operands of the integer
tensor cores, inputs as 15-bit fixed point) against the float64 reference and the fp16 variant of
the same kernel (GPU only, sm_90)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import GemvClusterSpy, capture, rel_fro
from test_exl3_gemv_cluster import SAME_TOL, TOL, _exact_w, _random_layer

from engine import kernels
from engine.kernels import gemv, loader, tuning

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]


@pytest.fixture(scope="module", autouse=True)
def _sm90(cuda_extension):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the int8 GEMV is a variant of the cluster GEMV (sm_90)")


def _int8(x, t, suh, svh, splits: int = 0) -> torch.Tensor:
    return gemv.exl3_gemv(x, t, suh, svh, "mul1", splits=splits, cluster=True, int8=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("shape", [(128, 256), (384, 640), (2304, 384), (4096, 1024)])
def test_int8_matches_reference_and_fp16_kernel(shape: tuple[int, int], k: int, dtype: torch.dtype) -> None:
    trellis, suh, svh = _random_layer(*shape, k, seed=11 * k + shape[0])
    w = _exact_w(trellis, suh, svh, "mul1")
    for m in range(1, gemv.GEMV_INT8_ROWS + 1):
        x = torch.randn(m, shape[0], device="cuda").to(dtype)
        y = _int8(x, trellis, suh, svh)
        assert y.shape == (m, shape[1]) and y.dtype == dtype
        assert rel_fro(y, x.double().cpu() @ w) < TOL[dtype], (m, k)
        fp16 = gemv.exl3_gemv(x, trellis, suh, svh, "mul1", cluster=True, int8=False)
        assert rel_fro(y, fp16) < (SAME_TOL if dtype != torch.bfloat16 else TOL[dtype]), (m, k)


def test_int8_every_split_count() -> None:
    """Each cluster size quantizes its own slice of the input (one scale per block and row)."""
    trellis, suh, svh = _random_layer(2048, 384, 4, seed=5)
    w = _exact_w(trellis, suh, svh, "mul1")
    x = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
    for splits in (1, 2, 3, 5, 8, 11, 16):
        try:
            y = _int8(x, trellis, suh, svh, splits=splits)
        except RuntimeError as exc:  # a cluster size above 8 this GPU cannot launch
            assert splits > 8 and "cannot be launched" in str(exc)
            continue
        assert rel_fro(y, x.double().cpu() @ w) < TOL[torch.float16], splits


def test_int8_input_outliers_and_zeros() -> None:
    """Fixed point is relative to the largest input of the block: one input 1000x the others must
    still give an fp16-accurate product (the Hadamard spreads it over its 128-chunk), an all-zero
    row gives exact zeros, and rows are scaled independently."""
    trellis, suh, svh = _random_layer(4096, 1024, 4, seed=9)
    w = _exact_w(trellis, suh, svh, "mul1")
    x = torch.randn(2, 4096, device="cuda", dtype=torch.float32)
    x[0, 77] = 1000.0
    x[1] *= 1e-3  # a small row beside a large one
    x[1, :128] = 0.0  # and a zero chunk inside it
    y = _int8(x, trellis, suh, svh)
    ref = x.double().cpu() @ w
    for n in range(2):
        assert rel_fro(y[n], ref[n]) < TOL[torch.float32], n
    zero = torch.zeros(1, 4096, device="cuda", dtype=torch.float16)
    assert torch.count_nonzero(_int8(zero, trellis, suh, svh)) == 0


def test_int8_propagates_nan_and_inf_like_the_fp16_kernel() -> None:
    """A non-finite input makes its row's outputs non-finite (as the fp16 kernels' do), not the
    finite values its fixed-point conversion would otherwise produce; the other row is unaffected."""
    trellis, suh, svh = _random_layer(2048, 384, 4, seed=4)
    w = _exact_w(trellis, suh, svh, "mul1")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 2048, device="cuda", dtype=torch.float16)
        x[0, 1000] = bad
        y = _int8(x, trellis, suh, svh)
        fp16 = gemv.exl3_gemv(x, trellis, suh, svh, "mul1", cluster=True, int8=False)
        assert not torch.isfinite(y[0]).any() and not torch.isfinite(fp16[0]).any(), bad
        assert rel_fro(y[1], x[1:].double().cpu() @ w) < TOL[torch.float16], bad


def test_int8_multi_launch_deterministic_and_graph_replay() -> None:
    """q/k/v in one launch = each matrix alone at the same split count, bit for bit; repeated
    calls and a replayed graph give the same bits."""
    layers = [_random_layer(4096, o, k, seed=o + k) for o, k in ((4096, 4), (1024, 5), (1024, 3))]
    ts, suhs, svhs = map(list, zip(*layers))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        return gemv.exl3_gemv_multi(x, ts, suhs, svhs, "mul1", splits=4, cluster=True, int8=True)

    first = step()
    for y, (t, suh, svh) in zip(first, layers):
        assert torch.equal(y, _int8(x, t, suh, svh, splits=4))
    assert all(torch.equal(a, b) for a, b in zip(step(), first))
    graph, outs = capture(step)
    for seed in (1, 2):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, step()))


def test_int8_is_the_default_where_it_applies(monkeypatch) -> None:
    """MUL1 at 1..GEMV_INT8_ROWS rows runs int8, nothing else; ``int8=False`` keeps the fp16
    variant; asking for int8 where it cannot run is a ValueError that says why."""
    spy = GemvClusterSpy(kernels.extension())
    monkeypatch.setattr(tuning, "_enabled", False)
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: spy)
    t, suh, svh = _random_layer(256, 384, 4, seed=2)
    for m in (1, gemv.GEMV_INT8_ROWS, gemv.GEMV_INT8_ROWS + 1):
        gemv.exl3_gemv(torch.randn(m, 256, device="cuda").half(), t, suh, svh, "mul1")
    gemv.exl3_gemv(torch.randn(1, 256, device="cuda").half(), t, suh, svh, "mcg")
    gemv.exl3_gemv(torch.randn(1, 256, device="cuda").half(), t, suh, svh, "mul1", int8=False)
    assert [kw["int8"] for kw in spy.kwargs] == [True, True, False, False, False]
    x = torch.randn(1, 256, device="cuda").half()
    with pytest.raises(ValueError, match="MUL1"):
        gemv.exl3_gemv(x, t, suh, svh, "mcg", int8=True)
    with pytest.raises(ValueError, match="rows"):
        gemv.exl3_gemv(torch.randn(5, 256, device="cuda").half(), t, suh, svh, "mul1", int8=True)
