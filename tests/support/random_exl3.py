"""Random streaming EXL3 linears on the GPU for kernel tests: trellis codes drawn uniformly,
sign vectors with random magnitudes (``suh`` scaled by ``1/sqrt(in)`` so outputs stay of order
one), padded to the 128-wide Hadamard blocks."""

from __future__ import annotations

import torch

from engine.exl3 import EXL3Linear


def random_streaming_linear(
    g: torch.Generator,
    n_in: int,
    n_out: int,
    bits: int = 4,
    codebook: str = "mul1",
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
) -> EXL3Linear:
    """An ``n_in -> n_out`` EXL3 linear in streaming mode, its tensors drawn from ``g`` (a CUDA
    generator), with a random bias where ``bias``."""
    pad_in, pad_out = -(-n_in // 128) * 128, -(-n_out // 128) * 128
    shape = (pad_in // 16, pad_out // 16, 16 * bits)
    trellis = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device="cuda", generator=g)
    sign = lambda n: torch.where(torch.rand(n, device="cuda", generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(pad_in) * (torch.rand(pad_in, device="cuda", generator=g) + 0.5) / n_in**0.5).half()
    svh = (sign(pad_out) * (torch.rand(pad_out, device="cuda", generator=g) + 0.5)).half()
    b = torch.randn(n_out, device="cuda", generator=g) if bias else None
    return EXL3Linear(trellis, suh, svh, codebook, n_in, n_out, b, mode="streaming", dtype=dtype)
