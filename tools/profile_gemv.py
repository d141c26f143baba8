"""Launch one EXL3 GEMV configuration a few times (for ncu / compute-sanitizer on the device).

Usage: python tools/profile_gemv.py IN OUT K M [codebook] [exact]
"""

from __future__ import annotations

import sys

import torch

from engine import ops


def main() -> None:
    in_f, out_f, k, m = (int(a) for a in sys.argv[1:5])
    codebook = sys.argv[5] if len(sys.argv) > 5 else "mcg"
    fast = not (len(sys.argv) > 6 and sys.argv[6] == "exact")
    trellis = torch.randint(
        -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, device="cuda"
    )
    suh = (torch.rand(in_f, device="cuda") + 0.5).half()
    svh = (torch.rand(out_f, device="cuda") + 0.5).half()
    x = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
    for _ in range(3):
        y = ops.exl3_gemv(x, trellis, suh, svh, codebook, fast=fast)
    torch.cuda.synchronize()
    print("ok", tuple(y.shape), float(y.float().abs().mean()))


if __name__ == "__main__":
    main()
