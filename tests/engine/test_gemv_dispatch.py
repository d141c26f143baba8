"""CPU tests of which EXL3 GEMV kernel engine.kernels.gemv runs, and of the bench's A/B flag (no GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from engine.cli import build_parser
from engine.exl3 import EXL3Linear
from engine.exl3.codebooks import FLAG_VALUES
from engine.exl3.reconstruct import apply_scales, decode_trellis
from engine.kernels import gemv, loader

CODEBOOK_NAMES = {v: k for k, v in loader.CODEBOOK_IDS.items()}


def test_both_gemv_kernels_are_built_and_hashed() -> None:
    assert {"exl3_gemv_cluster.cu", "exl3_gemv_mul1.cu"} <= set(loader.SOURCES)
    assert {"exl3_gemv_cluster.cuh", "exl3_gemv.cuh"} <= set(loader.HEADERS)
    for name in ("exl3_gemv_cluster.cu", "exl3_gemv_cluster.cuh", "exl3_gemv.cuh"):
        assert (loader.EXT_DIR / name).is_file()


def test_the_cluster_gemv_runs_where_the_gpu_has_clusters(monkeypatch) -> None:
    x = torch.zeros(1, 128)
    with_cluster = types.SimpleNamespace(exl3_gemv_cluster=lambda *a, **k: 0)
    without_cluster = types.SimpleNamespace()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert gemv._use_cluster(with_cluster, x, None)
    assert not gemv._use_cluster(with_cluster, x, False)  # the workspace GEMV, asked for
    assert not gemv._use_cluster(without_cluster, x, None)  # an extension built without it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not gemv._use_cluster(with_cluster, x, None)  # sm_80: no clusters, the portable GEMV
    with pytest.raises(ValueError, match="sm_90"):
        gemv._use_cluster(with_cluster, x, True)


def test_forced_splits_are_checked_in_python(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ext = types.SimpleNamespace(exl3_gemv_cluster=lambda *a, **k: 0)
    x = torch.zeros(1, 4096)  # 32 chunks: 2..16 splits
    assert gemv._use_cluster(ext, x, None, splits=2)
    with pytest.raises(ValueError, match=r"\[2, 16\]"):
        gemv._use_cluster(ext, x, None, splits=1)


def test_the_int8_variant_takes_mul1_at_one_or_two_rows() -> None:
    assert gemv._int8("mul1", None, 1) and gemv._int8("mul1", None, 2)
    assert not gemv._int8("mul1", None, 3) and not gemv._int8("mcg", None, 1)
    assert not gemv._int8("mul1", False, 1)  # the fp16 variant, asked for
    with pytest.raises(ValueError, match="MUL1"):
        gemv._int8("mcg", True, 1)
    with pytest.raises(ValueError, match="rows"):
        gemv._int8("mul1", True, 3)


def test_cpu_tensors_get_no_kernel() -> None:
    t = torch.zeros(8, 8, 64, dtype=torch.int16)
    suh, svh = torch.ones(128, dtype=torch.float16), torch.ones(128, dtype=torch.float16)
    assert gemv.exl3_gemv(torch.zeros(1, 128), t, suh, svh, "mcg") is None
    with pytest.raises(ValueError, match="activations"):
        gemv.exl3_gemv(torch.zeros(gemv.GEMV_MAX_ROWS + 1, 128), t, suh, svh, "mcg")


class WorkspaceGemvStandIn(types.SimpleNamespace):
    """The portable GEMV's bindings (no cluster GEMV) and the whole-weight binding, computed with
    the torch reference; records the rows of every GEMV launch and every whole-weight decode."""

    def __init__(self) -> None:
        super().__init__(gemv_rows=[], weights=0)

    @staticmethod
    def _w(trellis, suh, svh, codebook: int) -> torch.Tensor:
        return apply_scales(decode_trellis(trellis, CODEBOOK_NAMES[codebook]), suh, svh, torch.float32)

    def exl3_gemv(self, x, trellis, suh, svh, y, partial, counters, codebook, splits):
        self.gemv_rows.append(x.shape[0])
        y.copy_(x.float() @ self._w(trellis, suh, svh, codebook))
        return splits or 1

    def exl3_gemv_multi(self, x, trellises, suhs, svhs, ys, partial, counters, codebook, splits):
        self.gemv_rows.append(x.shape[0])
        for t, suh, svh, y in zip(trellises, suhs, svhs, ys, strict=True):
            y.copy_(x.float() @ self._w(t, suh, svh, codebook))
        return splits or 1

    def exl3_weight_into(self, trellis, suh, svh, codebook, w, col0):
        self.weights += 1
        ref = self._w(trellis, suh, svh, codebook)
        w[:, col0 : col0 + ref.shape[1]] = ref.to(w.dtype)


def _streaming_layer(in_f: int, out_f: int, k: int, seed: int) -> EXL3Linear:
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(in_f + out_f, generator=g) < 0.5, -1.0, 1.0)
    tensors = {
        "trellis": torch.randint(
            -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, generator=g
        ),
        "suh": (sign[:in_f] * (torch.rand(in_f, generator=g) + 0.5)).half(),
        "svh": (sign[in_f:] * (torch.rand(out_f, generator=g) + 0.5)).half(),
        "mcg": torch.tensor(FLAG_VALUES["mcg"]),
    }
    return EXL3Linear.from_tensors(tensors, in_f, out_f, None, mode="streaming")


@pytest.fixture
def stand_in(monkeypatch) -> WorkspaceGemvStandIn:
    ext = WorkspaceGemvStandIn()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: ext)  # CPU tensors take the "kernel"
    gemv.clear_workspaces()
    yield ext
    gemv.clear_workspaces()


def test_up_to_sixteen_rows_are_one_gemv_launch(stand_in) -> None:
    """A verify step of 1 + k <= 16 rows stays on the GEMV, one launch for all its rows (two MMA
    column groups above 8 rows); one row more decodes the whole weight for a GEMM."""
    assert gemv.GEMV_MAX_ROWS == gemv.GEMV_ROWS == 16
    layer = _streaming_layer(256, 384, 4, seed=1)
    reference = layer.reconstruct().t().float()
    for rows in (1, 8, 9, 13, 16):
        x = torch.randn(rows, 256)
        y = gemv.exl3_gemm(x, layer)
        assert stand_in.gemv_rows[-1] == rows and stand_in.weights == 0
        torch.testing.assert_close(y, x @ reference, rtol=1e-4, atol=1e-4)
    assert len(stand_in.gemv_rows) == 5
    y = gemv.exl3_gemm(torch.randn(17, 256), layer)
    assert stand_in.weights == 1 and len(stand_in.gemv_rows) == 5 and y.shape == (17, 384)


def test_workspace_splits_follow_the_rows(stand_in) -> None:
    """The workspace GEMV's blocks hold 16 input chunks up to 8 rows and 8 above: 4096 features
    (32 chunks) take 2..16 splits at 8 rows, 4..16 at 9..16 rows; the check is Python's."""
    layers = [_streaming_layer(4096, 128, 2, seed=s) for s in (2, 3)]
    ts = [layer.trellis for layer in layers]
    suhs, svhs = [layer.suh for layer in layers], [layer.svh for layer in layers]
    gemv.exl3_gemv_multi(torch.randn(8, 4096), ts, suhs, svhs, "mcg", splits=2, cluster=False)
    gemv.exl3_gemv_multi(torch.randn(12, 4096), ts, suhs, svhs, "mcg", splits=4, cluster=False)
    assert stand_in.gemv_rows == [8, 12]
    with pytest.raises(ValueError, match=r"\[4, 16\]"):
        gemv.exl3_gemv_multi(torch.randn(12, 4096), ts, suhs, svhs, "mcg", splits=3, cluster=False)
    with pytest.raises(ValueError, match=r"\[2, 16\]"):
        gemv.exl3_gemv_multi(torch.randn(8, 4096), ts, suhs, svhs, "mcg", splits=17, cluster=False)


def test_workspace_holds_the_most_splits_of_its_rows(stand_in) -> None:
    # 28672 features = 224 chunks: 14 splits at least up to 8 rows, 28 above (8 chunks a block).
    assert gemv._workspace_split_range(28672, 8) == (14, 16)
    assert gemv._workspace_split_range(28672, 16) == (28, 28)
    partial, counters = gemv._workspace(torch.device("cpu"), 28672, 1024, rows=16)
    assert partial.numel() >= 28 * 16 * 1024 and counters.numel() >= 8
    assert not counters.any()


def test_bench_kernels_ab_flag_parses() -> None:
    args = build_parser().parse_args(["bench-kernels", "--gemv-ab", "--bits", "2,4", "--batch", "1,8"])
    assert args.gemv_ab and args.bits == "2,4"
    assert not build_parser().parse_args(["bench-kernels"]).gemv_ab
