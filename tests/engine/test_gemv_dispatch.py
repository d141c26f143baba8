"""CPU tests of which EXL3 GEMV kernel engine.kernels.gemv runs, and of the bench's A/B flag (no GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from engine.cli import build_parser
from engine.kernels import gemv, loader


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
        gemv.exl3_gemv(torch.zeros(9, 128), t, suh, svh, "mcg")


def test_bench_kernels_ab_flag_parses() -> None:
    args = build_parser().parse_args(["bench-kernels", "--gemv-ab", "--bits", "2,4", "--batch", "1,8"])
    assert args.gemv_ab and args.bits == "2,4"
    assert not build_parser().parse_args(["bench-kernels"]).gemv_ab
