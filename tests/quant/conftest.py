"""Shared helpers for the EXL3 tests (the fixture lookup itself is in tests/conftest.py)."""

from __future__ import annotations

import torch

VARIANTS = ("4.0bpw-h6-mul1", "2.5bpw-h4-mcg", "5.5bpw-h8-3inst")


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns, for bit-exact comparisons (treats -0.0 and 0.0 as different, NaNs equal)."""
    return x.to(torch.float16).view(torch.int16)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (both taken as float64)."""
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))
