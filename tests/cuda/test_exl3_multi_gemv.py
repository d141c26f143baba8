"""Multi-matrix EXL3 GEMV (one launch for q/k/v or gate/up) against separate launches (GPU only)."""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_helpers import capture, needs_kernels

from engine import kernels
from engine.exl3 import EXL3Linear
from engine.exl3.codebooks import CODEBOOKS
from engine.kernels import gemv
from engine.modules.linear import ProjectionGroup

pytestmark = pytest.mark.cuda

# (in features, [(out features, K) per matrix]): Llama-3.1-8B / 3.2-1B q/k/v and gate/up with
# mixed bits, plus small shapes (one split possible, odd group counts).
CONFIGS = {
    "8b_qkv": (4096, [(4096, 4), (1024, 5), (1024, 3)]),
    "8b_gate_up": (4096, [(14336, 4), (14336, 2)]),
    "1b_qkv": (2048, [(2048, 2), (512, 6), (512, 8)]),
    "1b_gate_up": (2048, [(8192, 3), (8192, 3)]),
    "small": (256, [(384, 1), (128, 7), (640, 4)]),
}
# Same computation, fp32 atomics in another order: a rare 1-ulp flip of an output (a wrong block
# or workspace region would give errors of order 1).
SAME_TOL = 5e-4


_multi_kernel = needs_kernels("exl3_gemv_multi")


@functools.cache
def _layers(config: str, seed: int = 0):
    in_f, mats = CONFIGS[config]
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for out_f, k in mats:
        t = torch.randint(
            -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, device="cuda", generator=g
        )
        sign_in = torch.where(torch.rand(in_f, device="cuda", generator=g) < 0.5, -1.0, 1.0)
        suh = (sign_in * (torch.rand(in_f, device="cuda", generator=g) + 0.5)).half()
        sign_out = torch.where(torch.rand(out_f, device="cuda", generator=g) < 0.5, -1.0, 1.0)
        svh = (sign_out * (torch.rand(out_f, device="cuda", generator=g) + 0.5)).half()
        out.append((t, suh, svh))
    return out


def _x(m: int, in_f: int, dtype=torch.float16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    return torch.randn(m, in_f, device="cuda", generator=g).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def _counters_zero() -> bool:
    return all(int(ws[1].abs().sum()) == 0 for ws in gemv.workspaces())


# None: the GPU's GEMV (the cluster one on sm_90+); False: the workspace GEMV, the portable one.
@pytest.mark.parametrize("cluster", [None, False], ids=["default", "workspace"])
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_multi_equals_separate(config: str, codebook: str, cluster: bool | None) -> None:
    in_f, _ = CONFIGS[config]
    layers = _layers(config)
    ts, suhs, svhs = zip(*layers)
    n_chunks = in_f // 128
    cluster_runs = gemv._cluster_runs(kernels.extension(), torch.device("cuda"), cluster)
    for m in range(1, 17):  # 9..16: the two-column-group kernels
        x = _x(m, in_f)
        # chunks a block holds: 16, but 8 in the workspace GEMV's 9..16-row blocks
        min_splits = -(-n_chunks // (16 if cluster_runs else gemv._workspace_chunks(m)))
        # Same split count: every block does the same work as the single launch's block (g, s);
        # only the order of the 8 warps' shared-memory atomics varies (run to run, in either
        # launch), so the outputs agree to within an fp16 rounding of a few elements.
        for splits in sorted({min_splits, max(min_splits, min(n_chunks, 3))}):
            ys = gemv.exl3_gemv_multi(
                x, list(ts), list(suhs), list(svhs), codebook, splits=splits, cluster=cluster
            )
            for (t, suh, svh), y in zip(layers, ys):
                ref = gemv.exl3_gemv(x, t, suh, svh, codebook, splits=splits, cluster=cluster)
                assert y.shape == ref.shape and y.dtype == ref.dtype
                assert _rel(y, ref) < SAME_TOL, (config, codebook, cluster, m, splits)
        # The launch's own split choice: only the fp32 split-sum order differs.
        ys = gemv.exl3_gemv_multi(x, list(ts), list(suhs), list(svhs), codebook, cluster=cluster)
        for (t, suh, svh), y in zip(layers, ys):
            ref = gemv.exl3_gemv(x, t, suh, svh, codebook, cluster=cluster)
            assert _rel(y, ref) < 2e-3, (config, codebook, cluster, m)
    torch.cuda.synchronize()
    assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_multi_other_dtypes(dtype: torch.dtype) -> None:
    in_f, _ = CONFIGS["1b_qkv"]
    layers = _layers("1b_qkv")
    ts, suhs, svhs = zip(*layers)
    for m in (1, 5, 8, 11, 16):
        x = _x(m, in_f, dtype)
        ys = gemv.exl3_gemv_multi(x, list(ts), list(suhs), list(svhs), "mcg", splits=4)
        for (t, suh, svh), y in zip(layers, ys):
            assert y.dtype == dtype
            assert _rel(y, gemv.exl3_gemv(x, t, suh, svh, "mcg", splits=4)) < SAME_TOL


def test_single_matrix_multi_launch() -> None:
    in_f, _ = CONFIGS["8b_qkv"]
    t, suh, svh = _layers("8b_qkv")[0]
    x = _x(3, in_f)
    (y,) = gemv.exl3_gemv_multi(x, [t], [suh], [svh], "3inst", splits=8)
    assert _rel(y, gemv.exl3_gemv(x, t, suh, svh, "3inst", splits=8)) < SAME_TOL


@pytest.mark.parametrize("config", ["8b_qkv", "8b_gate_up"])
def test_multi_graph_replay_equals_eager(config: str) -> None:
    in_f, _ = CONFIGS[config]
    layers = _layers(config)
    ts, suhs, svhs = zip(*layers)
    x_static = _x(4, in_f)
    eager_first = gemv.exl3_gemv_multi(
        x_static, list(ts), list(suhs), list(svhs), "mcg"
    )  # sizes the workspace
    graph, ys_graph = capture(lambda: gemv.exl3_gemv_multi(x_static, list(ts), list(suhs), list(svhs), "mcg"))
    for seed in (7, 8, 9):
        x_static.copy_(_x(4, in_f, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        eager = gemv.exl3_gemv_multi(x_static, list(ts), list(suhs), list(svhs), "mcg")
        for a, b in zip(ys_graph, eager):
            assert _rel(a, b) < SAME_TOL
    assert _counters_zero()
    assert len(eager_first) == len(layers)


def _exl3_linear(
    t, suh, svh, codebook: str, out_features: int | None = None, bias: bool = False
) -> EXL3Linear:
    in_f, out_f = t.shape[0] * 16, t.shape[1] * 16
    out_features = out_features or out_f
    b = torch.randn(out_features, device="cuda") if bias else None
    return EXL3Linear(t, suh, svh, codebook, in_f, out_features, b, mode="streaming", dtype=torch.float16)


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("rows", [2, 12])  # 12: a verify step's rows, two column groups
@pytest.mark.parametrize("config", ["8b_qkv", "1b_gate_up", "small"])
def test_projection_group_uses_one_launch(monkeypatch, config: str, rows: int) -> None:
    in_f, _ = CONFIGS[config]
    # Trimmed out features and a bias on the last matrix: the padded-output/bias handling too.
    linears = [_exl3_linear(t, suh, svh, "mcg") for t, suh, svh in _layers(config)]
    t, suh, svh = _layers(config)[-1]
    linears[-1] = _exl3_linear(t, suh, svh, "mcg", out_features=t.shape[1] * 16 - 40, bias=True)
    group = ProjectionGroup([(lin, [lin.out_features]) for lin in linears])
    x = _x(rows, in_f).reshape(1, rows, in_f)
    expected = [lin(x) for lin in linears]
    multi, single = _Spy(gemv.exl3_gemv_multi), _Spy(gemv.exl3_gemv)
    monkeypatch.setattr(gemv, "exl3_gemv_multi", multi)
    monkeypatch.setattr(gemv, "exl3_gemv", single)
    outs = group(x)
    assert multi.calls == 1 and single.calls == 0
    assert [o.shape for o in outs] == [e.shape for e in expected]
    for o, e in zip(outs, expected):
        assert _rel(o, e) < 2e-3


def test_projection_group_falls_back(monkeypatch) -> None:
    layers = _layers("1b_qkv")
    in_f, _ = CONFIGS["1b_qkv"]
    mixed = [_exl3_linear(*layers[0], "mcg"), _exl3_linear(*layers[1], "mul1")]  # codebooks differ
    multi = _Spy(gemv.exl3_gemv_multi)
    monkeypatch.setattr(gemv, "exl3_gemv_multi", multi)
    group = ProjectionGroup([(lin, [lin.out_features]) for lin in mixed])
    outs = group(_x(1, in_f))
    assert multi.calls == 0 and len(outs) == 2
    same = ProjectionGroup([(_exl3_linear(*layer, "mcg"), [layer[0].shape[1] * 16]) for layer in layers])
    outs = same(_x(1, in_f).repeat(17, 1))  # 17 rows: above the GEMV's 16, the whole-weight path
    assert multi.calls == 0 and outs[0].shape == (17, 2048)


def test_multi_rejects_bad_input() -> None:
    layers = _layers("1b_qkv")
    ts, suhs, svhs = zip(*layers)
    x = _x(1, 2048)
    with pytest.raises(ValueError):
        gemv.exl3_gemv_multi(x, list(ts) + [ts[0]], list(suhs) + [suhs[0]], list(svhs) + [svhs[0]], "mcg")
    with pytest.raises(ValueError):
        gemv.exl3_gemv_multi(_x(17, 2048), list(ts), list(suhs), list(svhs), "mcg")
    small_t, small_suh, small_svh = _layers("small")[0]
    with pytest.raises(ValueError):  # in features differ
        gemv.exl3_gemv_multi(x, [ts[0], small_t], [suhs[0], small_suh], [svhs[0], small_svh], "mcg")
