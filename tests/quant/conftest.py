"""Shared helpers for the EXL3 tests: locating the reference fixtures (never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

VARIANTS = ("4.0bpw-h6-mul1", "2.5bpw-h4-mcg", "5.5bpw-h8-3inst")


def _shared_candidates() -> list[Path]:
    found = [Path(__file__).parents[2] / ".." / "shared"]
    env = os.environ.get("TRELLIS_SHARED")
    if env:
        found.append(Path(env))
    return found


def exl3_fixture_dir() -> Path | None:
    """``shared/fixtures/exl3`` next to the repository, else under ``$TRELLIS_SHARED``."""
    for shared in _shared_candidates():
        d = shared / "fixtures" / "exl3"
        if (d / "reference" / "codebook_tables.safetensors").is_file():
            return d.resolve()
    return None


@pytest.fixture(scope="session")
def exl3_dir() -> Path:
    d = exl3_fixture_dir()
    if d is None:
        pytest.skip(
            "EXL3 reference fixtures not found (looked for shared/fixtures/exl3 beside the repository "
            "and under $TRELLIS_SHARED)"
        )
    return d


@pytest.fixture(scope="session")
def ref(exl3_dir: Path):
    """``ref(name)`` -> dict of tensors of ``reference/<name>.safetensors`` (cached)."""
    from safetensors.torch import load_file

    cache: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_file(str(exl3_dir / "reference" / f"{name}.safetensors"))
        return cache[name]

    return load


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns, for bit-exact comparisons (treats -0.0 and 0.0 as different, NaNs equal)."""
    return x.to(torch.float16).view(torch.int16)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (both taken as float64)."""
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))
