"""xIELU (Huang & Schlag, 2024: "Deriving Activation Functions Using Integration"), the activation
of Apertus' MLPs: a learned square on the positive side, a learned exponential-minus-linear on the
negative side, both beside a fixed linear term ``beta * x``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class XIELU(nn.Module):
    """``a_p * x^2 + beta * x`` for ``x > 0``, else ``a_n * (expm1(min(x, eps)) - x) + beta * x``.

    The checkpoint stores each layer's ``alpha_p`` and ``alpha_n`` (shape ``[1]``) before the
    softplus that keeps the curvatures positive: ``a_p = softplus(alpha_p)``,
    ``a_n = beta + softplus(alpha_n)``. ``beta`` and ``eps`` (0-d tensors) are fixed by the model:
    0.5 and -1e-6 in Apertus, in the weights' dtype, where the checkpoint does not store them;
    ``eps`` keeps the exponential's argument off zero.
    """

    def __init__(
        self,
        alpha_p: torch.Tensor,
        alpha_n: torch.Tensor,
        beta: torch.Tensor | None = None,
        eps: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        like = {"dtype": alpha_p.dtype, "device": alpha_p.device}
        beta = torch.tensor(0.5, **like) if beta is None else beta.reshape(())
        eps = torch.tensor(-1e-6, **like) if eps is None else eps.reshape(())
        # Tensors, not Python numbers: nothing is read back to the host (the weights may be on
        # the meta device while a converter lists them). The softplus runs once, in the weights'
        # dtype as the reference runs it on every call.
        self.register_buffer("positive", F.softplus(alpha_p))
        self.register_buffer("negative", beta + F.softplus(alpha_n))
        self.register_buffer("beta", beta)
        self.register_buffer("eps", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.beta * x
        positive = self.positive * x * x + linear
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * self.negative + linear
        return torch.where(x > 0, positive, negative)
