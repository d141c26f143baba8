"""CPU tests of how engine.ops selects the GEMV v5 kernel and of the bench's A/B flag (no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import torch

from engine import ext_build, ops
from engine.cli import build_parser


def test_v5_sources_are_built_and_hashed() -> None:
    assert "exl3_gemv_v5.cu" in ext_build.SOURCES and "exl3_gemv_v5.cuh" in ext_build.HEADERS
    for name in ("exl3_gemv_v5.cu", "exl3_gemv_v5.cuh"):
        assert (ext_build.EXT_DIR / name).is_file()


def test_use_v5_needs_the_flag_and_the_binding(monkeypatch) -> None:
    x = torch.zeros(1, 128)
    with_v5 = types.SimpleNamespace(exl3_gemv_v5=lambda *a: 0)
    without_v5 = types.SimpleNamespace()
    monkeypatch.setattr(ops, "GEMV_V5", False)
    assert not ops._use_v5(with_v5, x, None)  # TRELLIS_GEMV_V5=0
    assert not ops._use_v5(with_v5, x, False)
    assert not ops._use_v5(without_v5, x, True)  # an extension built without v5: v4 runs
    monkeypatch.setattr(ops, "GEMV_V5", True)
    assert not ops._use_v5(with_v5, x, False)  # the per-call argument wins over the env default
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not ops._use_v5(with_v5, x, None)  # sm_80: no clusters, v4 runs
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert ops._use_v5(with_v5, x, None)


def test_v5_is_the_default_and_zero_selects_v4() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRELLIS_GEMV_V5"}
    code = "import engine.ops as o; print(o.GEMV_V5)"
    for value, expected in ((None, "True"), ("0", "False"), ("1", "True")):
        run_env = env if value is None else {**env, "TRELLIS_GEMV_V5": value}
        cmd = [sys.executable, "-c", code]
        out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr)


def test_bench_kernels_ab_flag_parses() -> None:
    args = build_parser().parse_args(["bench-kernels", "--gemv-ab", "--bits", "2,4", "--batch", "1,8"])
    assert args.gemv_ab and args.bits == "2,4"
    assert not build_parser().parse_args(["bench-kernels"]).gemv_ab
