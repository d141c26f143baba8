"""Linears and embeddings over int8 weights with one scale per output row (``engine.loading.int8``),
kept as stored and multiplied on the fly: the CPU path of the compact format.

The matmul is torch's weight-only int8 kernel (``aten._weight_int8pack_mm``: bfloat16 activations,
int8 weights, a bfloat16 scale per output row, float32 accumulation). Its bfloat16 kernel is
vectorized (AVX2, AVX-512); the float32 one is scalar and far slower, so a float32 model's
activations go through it in bfloat16 and come back in float32. The kernel computes each row of
the input alike whatever their number; the rounding to bfloat16 can still turn a difference in the
last float32 bits upstream (attention over a different number of rows) into a different value, so
greedy replies of differently batched runs may part at a near-tie, as in half precision on a GPU.

The kernel reads the input dimension in vectors of 16 with no tail (other widths give wrong sums
or crash), so it is used only for widths that are a multiple of :data:`KERNEL_WIDTH`, and only
after it computed a small known product right once in this process. It loads both operands with
aligned vector loads: codes at any byte of a file, or an activation that is a view into a larger
tensor, would crash the process, so both are copied to :data:`ALIGNMENT` first where they are not.
Otherwise (or where the kernel is missing: an older or unusual torch build) the weights are
dequantized per call, a block of rows at a time, in the activations' dtype.

On a GPU the builder dequantizes these weights once at load instead (``engine.loading.builder``).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

_KERNEL_DTYPE = torch.bfloat16
_FALLBACK_ROWS = 4096  # output rows dequantized at a time without the kernel (~9 MB at 576 columns)


KERNEL_WIDTH = 64
ALIGNMENT = 64  # bytes: an AVX-512 vector


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at an :data:`ALIGNMENT` address (a fresh CPU allocation always is)."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@cache
def _kernel():
    """``aten._weight_int8pack_mm`` if this torch has it and it multiplies a known case right."""
    kernel = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if kernel is None:
        return None
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (24, 2 * KERNEL_WIDTH), generator=g, dtype=torch.int8)
    scale = torch.rand(24, generator=g) + 0.5
    x = torch.randn(5, 2 * KERNEL_WIDTH, generator=g).to(_KERNEL_DTYPE)
    expected = x.float() @ (codes.float() * scale.to(_KERNEL_DTYPE).float()[:, None]).T
    try:
        got = kernel(x, codes, scale.to(_KERNEL_DTYPE)).float()
    except (RuntimeError, NotImplementedError):
        return None
    error = (got - expected).abs().max() / expected.abs().max()
    return kernel if bool(error < 0.02) else None


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a frozen parameter; one already (a tied head's, shared with the embedding)
    stays the same object, so the model counts and moves it once."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


class Int8Linear(nn.Module):
    """``x @ (codes * scale[:, None]).T + bias`` with int8 ``codes`` [out, in] and float ``scale`` [out]."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, key: str = ""
    ) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2 or list(scale.shape) != [codes.shape[0]]:
            raise ValueError(
                f"int8 codes [out, in] and scales [out] expected, got {codes.dtype} "
                f"{list(codes.shape)} and {list(scale.shape)}"
            )
        self.codes = _parameter(_aligned(codes))
        self.scale = _parameter(scale.to(torch.float32))
        self.register_buffer("kernel_scale", scale.to(_KERNEL_DTYPE), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = codes.shape
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        usable = x.device.type == "cpu" and self.in_features % KERNEL_WIDTH == 0 and flat.shape[0] > 0
        kernel = _kernel() if usable else None
        if kernel is not None:
            y = kernel(_aligned(flat.to(_KERNEL_DTYPE)), self.codes, self.kernel_scale).to(x.dtype)
        else:
            y = torch.cat(
                [
                    F.linear(flat, self.codes[i : i + _FALLBACK_ROWS].to(x.dtype))
                    * self.scale[i : i + _FALLBACK_ROWS].to(x.dtype)
                    for i in range(0, self.out_features, _FALLBACK_ROWS)
                ],
                dim=-1,
            )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a float matrix [out, in]."""
        return (self.codes.to(torch.float32) * self.scale[:, None]).to(dtype)


class Int8Embedding(nn.Module):
    """An embedding table of int8 rows, each with its scale; looked-up rows come out in ``dtype``.

    ``weight`` holds the codes (so the table's shape and storage read as an ``nn.Embedding``'s do);
    :meth:`head` shares them with a tied output projection.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2 or list(scale.shape) != [codes.shape[0]]:
            raise ValueError(
                f"int8 codes [vocab, hidden] and scales [vocab] expected, got {codes.dtype} "
                f"{list(codes.shape)} and {list(scale.shape)}"
            )
        self.weight = _parameter(_aligned(codes))
        self.scale = _parameter(scale.to(torch.float32))
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[input_ids].to(torch.float32) * self.scale[input_ids].unsqueeze(-1)
        return rows.to(self.dtype)

    def head(self, bias: torch.Tensor | None = None) -> Int8Linear:
        """The tied output projection (vocab <- hidden) over the same codes and scales."""
        return Int8Linear(self.weight, self.scale, bias)
