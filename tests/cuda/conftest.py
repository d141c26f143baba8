"""GPU tests of the CUDA extension: ``cuda``-marked tests are skipped where no GPU is visible.

The CPU tests in this folder (no marker) check the dispatch and fallback logic and run anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None and HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def exl3_fixture_dir() -> Path | None:
    """``shared/fixtures/exl3`` beside the repository, else under ``$TRELLIS_SHARED``."""
    candidates = [HERE.parents[1] / ".." / "shared"]
    if os.environ.get("TRELLIS_SHARED"):
        candidates.insert(0, Path(os.environ["TRELLIS_SHARED"]))
    for shared in candidates:
        d = shared / "fixtures" / "exl3"
        if (d / "reference" / "codebook_tables.safetensors").is_file():
            return d.resolve()
    return None


@pytest.fixture(scope="session")
def exl3_dir() -> Path:
    d = exl3_fixture_dir()
    if d is None:
        pytest.skip("EXL3 reference fixtures not found (shared/fixtures/exl3 or $TRELLIS_SHARED)")
    return d


@pytest.fixture(scope="session")
def ref(exl3_dir: Path):
    """``ref(name)`` -> tensors of ``reference/<name>.safetensors`` (cached)."""
    from safetensors.torch import load_file

    cache: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_file(str(exl3_dir / "reference" / f"{name}.safetensors"))
        return cache[name]

    return load


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (float64, on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))
