"""The one place that calls the CUDA extension (``ext/``).

Every function computes the same thing as a torch path elsewhere in the engine (which is also the
CPU path) and follows one convention: it returns a tensor (or a tuple or list of them), or None
where no kernel applies (CPU tensors, no extension, a case the kernels do not cover), and the
caller then runs its torch path. Arguments a kernel would refuse raise ``ValueError`` here, before
the extension sees them. Nothing here imports the rest of the engine: layers, cache stores and
sampling rows are passed in.

- :mod:`~engine.kernels.loader`: building and loading the extension, its process-wide settings,
  chained launches;
- :mod:`~engine.kernels.gemv`: EXL3 linears (the GEMVs, the whole-weight prefill kernel);
- :mod:`~engine.kernels.moe`: a mixture's router and routed EXL3 experts for a few tokens, on the device;
- :mod:`~engine.kernels.moe_grouped`: stacked EXL3 experts decoded whole for grouped prefill GEMMs;
- :mod:`~engine.kernels.tuning`: the GEMVs' split counts, timed per launch shape and per step;
- :mod:`~engine.kernels.attention`: paged decode attention and the KV cache's writes and reads;
- :mod:`~engine.kernels.fused`: norms, RoPE, the gated activation;
- :mod:`~engine.kernels.sampling`: argmax and the sampler;
- :mod:`~engine.kernels.viterbi`: the converter's Viterbi encoder.

Importing is free: the extension is built or loaded on the first call that sees a CUDA tensor.
"""

from __future__ import annotations

from pathlib import Path

from engine.kernels import attention, fused, gemv, loader, moe, moe_grouped, sampling, tuning, viterbi
from engine.kernels.loader import chained_launches, chained_launches_supported, extension, status

__all__ = [
    "attention",
    "chained_launches",
    "chained_launches_supported",
    "configure",
    "extension",
    "fused",
    "gemv",
    "loader",
    "moe",
    "moe_grouped",
    "reset",
    "sampling",
    "status",
    "tuning",
    "viterbi",
]


def configure(
    *,
    use_extension: bool = True,
    prebuilt_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    gemv_tuning: bool = True,
) -> None:
    """The process's kernel settings (``EngineOptions.configure_kernels`` passes its fields):
    whether to use the extension at all, a prebuilt module's folder, the folder of JIT builds,
    and whether the GEMVs' split counts are timed. A changed extension setting forgets the loaded
    module, so the next call follows the new one."""
    if loader.configure(use_extension, prebuilt_dir, cache_dir):
        reset()
    tuning.enable(gemv_tuning)


def reset() -> None:
    """Forget the loaded extension and its buffers so the next call tries again (tests,
    ``build-ext``)."""
    loader.reset()
    gemv.clear_workspaces()
    moe.clear_workspaces()
