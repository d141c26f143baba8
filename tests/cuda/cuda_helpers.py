"""Helpers the GPU tests share: relative error against a reference, CUDA graph capture, a spy on
the extension's cluster GEMV, a module's demand for extension entry points."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

T = TypeVar("T")


def needs_kernels(*names: str) -> Callable[..., None]:
    """An autouse, module-scoped fixture that fails the module's tests (it does not skip them)
    where the extension was built without one of ``names``: kernel tests must not pass vacuously.
    Assign it to a module-level name: ``_kernels = needs_kernels("exl3_gemv_multi")``."""

    @pytest.fixture(scope="module", autouse=True)
    def _needs(cuda_extension) -> None:
        for name in names:
            if not hasattr(cuda_extension, name):
                pytest.fail(f"the CUDA extension was built without {name}")

    return _needs


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (float64, on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def capture(run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm ``run`` up on a side stream (first-call allocations, attribute and occupancy queries
    happen outside the capture), then capture one call of it. Returns the graph and that call's
    outputs, which every replay rewrites in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


class GemvClusterSpy:
    """Stands in for the extension module (``engine.kernels.loader.kernel_ready``'s answer): every
    ``exl3_gemv_cluster`` call's positional arguments are recorded in ``calls`` and its keyword
    arguments in ``kwargs``, then the call is passed on; everything else is the extension's."""

    def __init__(self, ext) -> None:
        self._ext = ext
        self.calls: list[tuple] = []
        self.kwargs: list[dict] = []

    def __getattr__(self, name: str):
        return getattr(self._ext, name)

    def exl3_gemv_cluster(self, *args, **kwargs):
        self.calls.append(args)
        self.kwargs.append(kwargs)
        return self._ext.exl3_gemv_cluster(*args, **kwargs)
