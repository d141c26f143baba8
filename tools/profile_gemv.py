"""Launch one EXL3 GEMV configuration a few times (for ncu / compute-sanitizer on the device).

Usage: python tools/profile_gemv.py IN OUT K M [codebook] [workspace]

``workspace`` runs the workspace split-K GEMV (the pre-sm_90 kernel) instead of the GPU's default.
"""

from __future__ import annotations

import sys

import torch

from engine.kernels import gemv
from engine.options import EngineOptions


def main() -> None:
    EngineOptions.from_environment().configure_kernels()
    in_f, out_f, k, m = (int(a) for a in sys.argv[1:5])
    codebook = sys.argv[5] if len(sys.argv) > 5 else "mcg"
    cluster = False if len(sys.argv) > 6 and sys.argv[6] == "workspace" else None
    trellis = torch.randint(
        -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, device="cuda"
    )
    suh = (torch.rand(in_f, device="cuda") + 0.5).half()
    svh = (torch.rand(out_f, device="cuda") + 0.5).half()
    x = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
    for _ in range(3):
        y = gemv.exl3_gemv(x, trellis, suh, svh, codebook, cluster=cluster)
    if y is None:
        raise SystemExit("the CUDA extension is unavailable")
    torch.cuda.synchronize()
    print("ok", tuple(y.shape), float(y.float().abs().mean()))


if __name__ == "__main__":
    main()
