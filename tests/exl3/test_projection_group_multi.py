"""ProjectionGroup over separate EXL3 linears: the CPU path (no multi-matrix GEMV) is unchanged."""

from __future__ import annotations

import torch

from engine.exl3 import EXL3Linear
from engine.kernels import gemv
from engine.modules.linear import ProjectionGroup


def _linear(in_f: int, out_f: int, k: int, seed: int) -> EXL3Linear:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, generator=g)
    suh = (torch.rand(in_f, generator=g) + 0.5).half()
    svh = (torch.rand(out_f, generator=g) + 0.5).half()
    return EXL3Linear(t, suh, svh, "mcg", in_f, out_f, mode="streaming")


def test_multi_gemm_not_used_on_cpu() -> None:
    linears = [_linear(128, 256, 3, 0), _linear(128, 128, 4, 1)]
    x = torch.randn(2, 128)
    assert gemv.exl3_gemm_multi(x, linears) is None
    outs = ProjectionGroup([(lin, [lin.out_features]) for lin in linears])(x)
    for out, lin in zip(outs, linears):
        assert torch.equal(out, lin(x))
