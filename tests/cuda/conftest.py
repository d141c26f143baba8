"""Fixtures of the GPU tests (run only where a CUDA GPU is present; see tests/conftest.py)."""

from __future__ import annotations

import pytest

from engine import kernels


@pytest.fixture(scope="module")
def cuda_extension():
    """The built CUDA extension. On a GPU machine its absence is a failure, not a skip: the kernel
    tests would otherwise pass vacuously."""
    ext = kernels.extension()
    if ext is None:
        pytest.fail(f"CUDA extension unavailable on a GPU machine: {kernels.status()['reason']}")
    return ext
