"""Keys or values stored at 2-8 bits per number, quantized as they are written.

Per token and head, the ``head_dim`` numbers are split into groups of ``G`` (32 where the head
size allows). Each group is rotated by an orthonormal ``G``-point Hadamard matrix first: the
rotation spreads an outlier channel over the whole group, so one scale per group fits all its
numbers well. Each rotated number is then rounded to one of ``2**bits`` evenly spaced levels
placed symmetrically around zero (no level at zero: after the rotation values are roughly
Gaussian and the symmetric "mid-rise" grid uses every code), with one fp16 scale per group.

Codes are stored as *bit planes*: for every 8 consecutive numbers, byte ``j`` holds bit ``j`` of
each of them. Any width 2..8 then packs without waste or straddling, and unpacking is a shift
and a mask, the same for every width.

Because the Hadamard matrix is orthonormal and symmetric, ``q . k = (Hq) . (Hk)`` and
``sum p_i v_i = H (sum p_i H v_i)``: a fused attention kernel can keep the cache rotated, rotate
the query once and the output once. This reference path simply rotates back when reading.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)


def hadamard_matrix(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n**0.5


def group_size(head_dim: int) -> int:
    for g in (32, 16, 8):
        if head_dim % g == 0:
            return g
    raise ValueError(f"quantized cache needs a head size divisible by 8, got {head_dim}")


class QuantizedStore:
    """One of a layer's key or value tensors, ``[slots, heads, head_dim]``, at ``bits`` bits."""

    def __init__(self, num_slots: int, heads: int, head_dim: int, bits: int, device) -> None:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"cache bits must be one of {SUPPORTED_BITS} (or 16), got {bits}")
        self.bits, self.head_dim = bits, head_dim
        self.group = group_size(head_dim)
        self.levels = 2**bits - 1
        self.codes = torch.zeros(num_slots, heads, head_dim // 8, bits, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(
            num_slots, heads, head_dim // self.group, dtype=torch.float16, device=device
        )
        self.hadamard = hadamard_matrix(self.group, device=device)
        self._shifts = torch.arange(8, dtype=torch.uint8, device=device)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (bit planes) and scales for ``x`` of shape ``[n, heads, head_dim]``."""
        n, heads, d = x.shape
        groups = x.float().reshape(n, heads, d // self.group, self.group) @ self.hadamard
        half = self.levels / 2
        scales = (groups.abs().amax(-1) / half).clamp_min(1e-8).to(torch.float16)
        q = torch.round(groups / scales.float()[..., None] + half).clamp_(0, self.levels).to(torch.uint8)
        bits = (
            q.reshape(n, heads, d // 8, 8, 1) >> torch.arange(self.bits, dtype=torch.uint8, device=x.device)
        ) & 1
        planes = (bits << self._shifts[:, None]).sum(dim=3, dtype=torch.uint8)  # [n, heads, d/8, bits]
        return planes, scales

    def dequantize(self, planes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, heads = planes.shape[:2]
        bits = (planes[:, :, :, None, :] >> self._shifts[:, None]) & 1  # [n, heads, d/8, 8, bits]
        weights = (1 << torch.arange(self.bits, device=planes.device)).to(torch.int32)
        q = (bits.to(torch.int32) * weights).sum(-1).float()  # [n, heads, d/8, 8]
        per_head = self.head_dim // self.group  # explicit: a read of zero slots has nothing to infer -1 from
        groups = (q.reshape(n, heads, per_head, self.group) - self.levels / 2) * scales.float()[..., None]
        return (groups @ self.hadamard).reshape(n, heads, self.head_dim).to(dtype)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        from engine import kernels

        if kernels.attention.quantized_cache_write(self, slots, x) is not None:  # one CUDA kernel, same codes
            return
        planes, scales = self.quantize(x)
        self.codes.index_copy_(0, slots, planes)
        self.scales.index_copy_(0, slots, scales)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from engine import kernels

        fast = kernels.attention.quantized_cache_read(self, slots, dtype)  # one CUDA kernel, same numbers
        if fast is not None:
            return fast
        return self.dequantize(self.codes.index_select(0, slots), self.scales.index_select(0, slots), dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2


class DenseStore:
    """Keys or values kept at the model's precision (the "fp16" cache)."""

    def __init__(self, num_slots: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.data = torch.zeros(num_slots, heads, head_dim, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        self.data.index_copy_(0, slots, x.to(self.data.dtype))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.data.index_select(0, slots).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def bytes_per_token(heads: int, head_dim: int, bits: int, dense_bytes: int = 2) -> int:
    """Cache bytes one token of one layer's keys (or values) takes at ``bits`` (16: dense)."""
    if bits >= 16:
        return heads * head_dim * dense_bytes
    return heads * (head_dim * bits // 8 + head_dim // group_size(head_dim) * 2)
