"""RMSNorm (Zhang & Sennrich, 2019), with the Gemma variant that stores ``weight - 1``."""

from __future__ import annotations

import torch
from torch import nn

from engine import kernels


class RMSNorm(nn.Module):
    """``y = x / rms(x) * (offset + weight)``, computed in float32 for stability.

    Gemma checkpoints store the scale as ``weight - 1`` (offset 1.0); Llama-style ones store it
    directly (offset 0.0). The normalised activations are rounded back to the input dtype before
    the scale is applied in the Llama convention and after it in the Gemma one; we follow each,
    because in bf16 the two orders round differently.
    """

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0, key: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.offset = offset
        self.key = key  # the checkpoint key it was read from ("" for one made otherwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused launch instead of ~8 elementwise kernels (ext/fused_ops.cu)
            fused = kernels.fused.rms_norm(x, self.weight, self.eps, self.offset)
            if fused is not None:
                return fused
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


def add_and_norm(h: torch.Tensor, delta: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, norm(h + delta))``: a residual add and the norm that reads its result.

    For an :class:`RMSNorm` on the GPU one fused launch computes both (ext/fused_ops.cu), with
    the sum rounded to the activation dtype exactly as ``h + delta`` stores it. Elsewhere (the CPU,
    other norms, mixed dtypes) this is literally the two torch steps, so results do not change.
    """
    if h.is_cuda and isinstance(norm, RMSNorm):
        fused = kernels.fused.add_rms_norm(h, delta, norm.weight, norm.eps, norm.offset)
        if fused is not None:
            return fused
    h = h + delta
    return h, norm(h)
