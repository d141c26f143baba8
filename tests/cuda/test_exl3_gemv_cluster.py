"""The cluster split-K GEMV (ext/exl3_gemv_cluster.cuh) against the torch reference and against the
workspace split-K GEMV (the portable one), for every K, codebook and row count 1..16 (GPU only,
sm_90; 9..16 rows are the two-column-group instances)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import GemvClusterSpy, capture, rel_fro

from engine import kernels
from engine.exl3.codebooks import CODEBOOKS
from engine.exl3.hadamard import blockwise_hadamard
from engine.exl3.reconstruct import apply_scales, decode_trellis
from engine.kernels import gemv, loader, tuning

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]

ALL_K = range(1, 9)
# As tests/cuda/test_exl3_kernels.py: u is rounded to fp16 (the MMA operand), the output to the
# activation dtype.
TOL = {torch.float16: 1.5e-3, torch.float32: 1.5e-3, torch.bfloat16: 6e-3}
# The two GEMVs compute the same products with fp32 sums in another order (and their split counts
# may differ): an fp16 output rounding apart, far below a wrong tile or row (errors of order 1).
SAME_TOL = 2e-3


def _random_layer(in_f: int, out_f: int, k: int, seed: int):
    """Random trellis and signed scales (as tests/cuda/test_exl3_kernels.py), on the GPU."""
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(
        -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, generator=g
    )
    suh = (
        torch.where(torch.rand(in_f, generator=g) < 0.5, -1.0, 1.0) * (torch.rand(in_f, generator=g) + 0.5)
    ).half()
    sign_out = torch.where(torch.rand(out_f, generator=g) < 0.5, -1.0, 1.0)
    svh = ((torch.rand(out_f, generator=g) + 0.5) * sign_out).half()
    return trellis.cuda(), suh.cuda(), svh.cuda()


def _exact_w(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str) -> torch.Tensor:
    """W (in, out) in float64 from the CPU reference decoder."""
    return apply_scales(decode_trellis(trellis.cpu(), codebook), suh.cpu(), svh.cpu(), torch.float64)


@pytest.fixture(scope="module", autouse=True)
def _cluster_kernel(cuda_extension):
    if not hasattr(cuda_extension, "exl3_gemv_cluster"):
        pytest.fail("the CUDA extension was built without exl3_gemv_cluster")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster GEMV needs sm_90 (thread-block clusters)")


def _reference(x: torch.Tensor, trellis, suh, svh, codebook: str) -> torch.Tensor:
    """had(had(x * suh) @ Q) * svh in float64 from the bit-exact decode (torch's, on the GPU)."""
    q = decode_trellis(trellis, codebook).double()
    u = blockwise_hadamard(x.double() * suh.double(), dim=-1)
    return blockwise_hadamard(u @ q, dim=-1) * svh.double()


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", ALL_K)
@pytest.mark.parametrize("shape", [(128, 256), (384, 640), (2304, 384)])
def test_every_k_codebook_and_row_count(codebook: str, k: int, shape: tuple[int, int]) -> None:
    trellis, suh, svh = _random_layer(*shape, k, seed=k * 7 + shape[1])
    w = _exact_w(trellis, suh, svh, codebook)
    for m in range(1, 17):
        x = torch.randn(m, shape[0], device="cuda", dtype=torch.float16)
        y = gemv.exl3_gemv(x, trellis, suh, svh, codebook, cluster=True)
        assert y.shape == (m, shape[1]) and y.dtype == torch.float16
        assert rel_fro(y, x.double().cpu() @ w) < TOL[torch.float16], (m, k, codebook)


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)])
def test_llama8b_shapes_match_reference_and_workspace(codebook: str, k: int, shape: tuple[int, int]) -> None:
    trellis, suh, svh = _random_layer(*shape, k, seed=shape[0] + shape[1] + k)
    for m in (1, 3, 8, 9, 16):
        x = torch.randn(m, shape[0], device="cuda", dtype=torch.float16)
        # fp16 variant on both sides (the int8 one is tests/cuda/test_exl3_gemv_int8.py's)
        y_cluster = gemv.exl3_gemv(x, trellis, suh, svh, codebook, cluster=True, int8=False)
        y_workspace = gemv.exl3_gemv(x, trellis, suh, svh, codebook, cluster=False)
        assert rel_fro(y_cluster, _reference(x, trellis, suh, svh, codebook)) < TOL[torch.float16], (m, k)
        assert rel_fro(y_cluster, y_workspace) < SAME_TOL, (m, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_split_count_and_dtype(dtype: torch.dtype) -> None:
    """Forced cluster sizes 1 (no split) .. 16 (non-portable; where the GPU launches it), odd
    sizes that do not divide the chunks, and the launch's own choice; every output written (at 16
    rows and one split, each warp writes two rows)."""
    ext = kernels.extension()
    trellis, suh, svh = _random_layer(2048, 384, 4, seed=3)
    w = _exact_w(trellis, suh, svh, "mul1")
    for m in (1, 3, 8, 9, 12, 16):
        x = torch.randn(m, 2048, device="cuda").to(dtype)
        for splits in (1, 2, 3, 5, 8, 11, 16, 0):
            y = torch.full((m, 384), float("nan"), device="cuda", dtype=dtype)
            try:
                used = ext.exl3_gemv_cluster(
                    x, [trellis], [suh], [svh], [y], loader.CODEBOOK_IDS["mul1"], splits, int8=False
                )
            except RuntimeError as exc:  # a cluster size above 8 this GPU cannot launch
                assert splits > 8 and "cannot be launched" in str(exc)
                continue
            assert used == splits or splits == 0
            assert torch.isfinite(y).all(), (splits, m)
            assert rel_fro(y, x.double().cpu() @ w) < TOL[dtype], (splits, m)


def test_deep_input_needs_several_splits() -> None:
    """14336 in features = 112 chunks: at least 7 splits (16 chunks per block at most)."""
    trellis, suh, svh = _random_layer(14336, 256, 3, seed=14)
    for m in (8, 16):
        x = torch.randn(m, 14336, device="cuda", dtype=torch.float16)
        expected = _reference(x, trellis, suh, svh, "3inst")
        for splits in (7, 8, 0):
            y = gemv.exl3_gemv(x, trellis, suh, svh, "3inst", splits=splits, cluster=True)
            assert rel_fro(y, expected) < TOL[torch.float16], (m, splits)
    with pytest.raises(ValueError, match="splits"):
        gemv.exl3_gemv(x, trellis, suh, svh, "3inst", splits=6, cluster=True)


def test_is_deterministic() -> None:
    """No atomics anywhere: the same input gives bit-identical outputs."""
    trellis, suh, svh = _random_layer(4096, 1024, 4, seed=21)
    for m in (5, 13):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        first = gemv.exl3_gemv(x, trellis, suh, svh, "mcg", cluster=True)
        for _ in range(5):
            assert torch.equal(gemv.exl3_gemv(x, trellis, suh, svh, "mcg", cluster=True), first)


# (in features, [(out features, K) per matrix]): Llama q/k/v and gate/up with mixed bits.
MULTI = {
    "8b_qkv": (4096, [(4096, 4), (1024, 5), (1024, 3)]),
    "8b_gate_up": (4096, [(14336, 4), (14336, 2)]),
    "1b_qkv": (2048, [(2048, 2), (512, 6), (512, 8)]),
    "small": (256, [(384, 1), (128, 7), (640, 4)]),
}


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("config", list(MULTI))
def test_multi_equals_single_launches_of_both_gemvs(config: str, codebook: str) -> None:
    in_f, mats = MULTI[config]
    layers = [_random_layer(in_f, o, k, seed=o + 13 * k) for o, k in mats]
    ts, suhs, svhs = zip(*layers)
    for m in (1, 2, 5, 8, 9, 16):
        x = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
        ys = gemv.exl3_gemv_multi(x, list(ts), list(suhs), list(svhs), codebook, cluster=True, int8=False)
        for (t, suh, svh), y in zip(layers, ys):
            ref = gemv.exl3_gemv(x, t, suh, svh, codebook, cluster=False)
            assert y.shape == ref.shape and y.dtype == ref.dtype
            assert rel_fro(y, ref) < SAME_TOL, (config, codebook, m)
            single = gemv.exl3_gemv(x, t, suh, svh, codebook, cluster=True, int8=False)
            assert rel_fro(y, single) < SAME_TOL, (config, codebook, m)


def test_graph_replay_equals_eager() -> None:
    in_f, mats = MULTI["8b_qkv"]
    layers = [_random_layer(in_f, o, k, seed=o + k) for o, k in mats]
    ts, suhs, svhs = zip(*layers)
    x = torch.randn(4, in_f, device="cuda", dtype=torch.float16)

    def step():
        return gemv.exl3_gemv_multi(x, list(ts), list(suhs), list(svhs), "mcg", cluster=True) + [
            gemv.exl3_gemv(x, ts[0], suhs[0], svhs[0], "mcg", cluster=True)
        ]

    graph, outs = capture(step)  # attributes and occupancy queries happen in the warm-up
    for seed in (7, 8, 9):
        x.copy_(torch.randn(4, in_f, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, step()):
            assert torch.equal(a, b)  # deterministic kernel: replay and eager agree bit for bit


def test_the_cluster_gemv_is_the_default_of_every_gemv(monkeypatch) -> None:
    """On sm_90+ both entry points run the cluster GEMV unless a caller asks otherwise."""
    spy = GemvClusterSpy(kernels.extension())
    monkeypatch.setattr(tuning, "_enabled", False)  # only the routed calls, no timing launches
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: spy)
    t, suh, svh = _random_layer(256, 384, 3, seed=2)
    x = torch.randn(2, 256, device="cuda", dtype=torch.float16)
    gemv.exl3_gemv(x, t, suh, svh, "mcg")
    gemv.exl3_gemv_multi(x, [t, t], [suh, suh], [svh, svh], "mcg")
    assert [len(args[1]) for args in spy.calls] == [1, 2]  # matrices per launch


def test_chained_waits_for_the_previous_kernels_output() -> None:
    """Chained (programmatic dependent launch) a GEMV may start during the previous kernel (its
    weight prefetch), and the cluster GEMV lets its successor start early (launch_dependents before its output
    is written): a chain of GEMVs, each reading the previous one's output, eager and in a graph,
    must equal the same chain unchained bit for bit."""
    layers = [_random_layer(2048, 2048, k, seed=40 + k) for k in (2, 4, 3)]
    x0 = torch.randn(3, 2048, device="cuda", dtype=torch.float16)

    def chain():
        h = x0 * 0.5  # a kernel right before the first GEMV writes its input
        for t, suh, svh in layers:
            h = gemv.exl3_gemv(h, t, suh, svh, "mcg", cluster=True)
            h = h / h.abs().amax()  # keep the scale bounded; another kernel in between
            h = gemv.exl3_gemv_multi(h, [t, t], [suh, suh], [svh, svh], "mcg", cluster=True)[1]
        return h

    expected = chain()
    with kernels.chained_launches(x0.device):
        for _ in range(3):
            assert torch.equal(chain(), expected)
        graph, out = capture(chain)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
