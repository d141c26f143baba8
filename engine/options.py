"""How the engine runs: one frozen options object, built once by the front end and passed down.

The CLI builds it from its flags, the app from its settings; for development both start from
:meth:`EngineOptions.from_environment`, the only place that reads the ``TRELLIS_*`` engine
switches. Nothing reads them at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path


def _flag(value: str | None) -> bool | None:
    """A switch's value: None when unset or empty, False for ``0``, True for anything else."""
    if value is None or value == "":
        return None
    return value != "0"


@dataclass(frozen=True)
class EngineOptions:
    """The engine's run-time options. The defaults are what users get; the rest is for
    debugging, A/B measurements and tests.

    Kernels (the process's, applied by :meth:`configure_kernels`: there is one CUDA extension per
    process):

    - ``use_extension``: use the CUDA extension where it can be had (off: the torch path
      everywhere, as on a CPU). Environment: ``TRELLIS_NO_EXT=1`` turns it off.
    - ``extension_prebuilt_dir``: a folder ``python -m engine build-ext --export DIR`` wrote; its
      module is loaded instead of a JIT build where it was built from the same sources for the
      same torch and GPU architecture. Environment: ``TRELLIS_EXT_PREBUILT=DIR``.
    - ``extension_cache_dir``: where JIT builds are kept (None: the user cache folder).
      Environment: ``TRELLIS_EXT_CACHE=DIR``.
    - ``gemv_tuning``: time the EXL3 GEMV's split counts once per launch shape (off: the kernel's
      own model decides). Environment: ``TRELLIS_GEMV_TUNE=0`` turns it off.

    Generation (a :class:`~engine.generation.generator.Generator`'s):

    - ``cuda_graphs``: replay decode steps from CUDA graphs on a CUDA model. Environment:
      ``TRELLIS_NO_GRAPHS=1`` turns them off.
    - ``pipelined_decode``: launch the next decode step from the tokens the last one left on the
      device, before the host reads them. None: where CUDA graphs run; True also elsewhere
      (it only costs syncs there, but works: the CPU tests use it). Environment:
      ``TRELLIS_NO_PIPELINE=1`` turns it off.
    - ``sampling_on_device``: draw sampled tokens where the logits are (the sampling kernel, or its
      torch reference off the GPU) instead of on the host. None: on a CUDA model; True also
      elsewhere (the CPU tests use it). Environment: ``TRELLIS_HOST_SAMPLING=1`` turns it off.
    - ``batched_decode``: run decode-only steps that no graph replays through the fixed-shape path,
      one paged-attention launch per layer for every row, instead of attending row by row. None:
      on a CUDA model (on the CPU the row-by-row path reads the cache in place and is faster).
    - ``step_tuning``: before a decode step shape is first captured, revise its GEMVs' split
      counts by timing whole steps (opt-in: +1.9% on the 1B shape, within noise on the 8B).
      Environment: ``TRELLIS_STEP_TUNE=1``.
    - ``draft``: speculative decoding's drafter (``engine.generation.speculative``): ``off``,
      ``ngram`` (prompt lookup), ``model:DIR`` (a smaller model with the same tokenizer) or
      ``mtp`` (the checkpoint's own multi-token-prediction layer), or ``auto`` (n-gram on
      the CPU, off on a GPU). Off by default for the library; the front ends ask for
      :meth:`with_front_end_draft`. Environment: ``TRELLIS_DRAFT``. ``draft_tokens``: the most
      tokens drafted per step (1..8; the draft length adapts below that to the acceptance rate).
      Environment: ``TRELLIS_DRAFT_TOKENS``.
    """

    use_extension: bool = True
    extension_prebuilt_dir: Path | None = None
    extension_cache_dir: Path | None = None
    gemv_tuning: bool = True
    cuda_graphs: bool = True
    pipelined_decode: bool | None = None
    sampling_on_device: bool | None = None
    batched_decode: bool | None = None
    step_tuning: bool = False
    draft: str = "off"
    draft_tokens: int = 4

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> EngineOptions:
        """The defaults with the development switches of ``environ`` (default ``os.environ``)
        applied; command-line flags go on top with ``dataclasses.replace``."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        if _flag(env.get("TRELLIS_NO_EXT")):
            values["use_extension"] = False
        if env.get("TRELLIS_EXT_PREBUILT"):
            values["extension_prebuilt_dir"] = Path(env["TRELLIS_EXT_PREBUILT"])
        if env.get("TRELLIS_EXT_CACHE"):
            values["extension_cache_dir"] = Path(env["TRELLIS_EXT_CACHE"])
        if _flag(env.get("TRELLIS_GEMV_TUNE")) is False:
            values["gemv_tuning"] = False
        if _flag(env.get("TRELLIS_NO_GRAPHS")):
            values["cuda_graphs"] = False
        if _flag(env.get("TRELLIS_NO_PIPELINE")):
            values["pipelined_decode"] = False
        if _flag(env.get("TRELLIS_HOST_SAMPLING")):
            values["sampling_on_device"] = False
        if _flag(env.get("TRELLIS_STEP_TUNE")):
            values["step_tuning"] = True
        if env.get("TRELLIS_DRAFT"):
            values["draft"] = env["TRELLIS_DRAFT"]
        if env.get("TRELLIS_DRAFT_TOKENS", "").strip().isdigit():
            values["draft_tokens"] = int(env["TRELLIS_DRAFT_TOKENS"])
        return cls(**values)

    def with_front_end_draft(self, environ: Mapping[str, str] | None = None) -> EngineOptions:
        """These options with the drafter users get by default (:data:`FRONT_END_DRAFT`) unless
        ``TRELLIS_DRAFT`` in ``environ`` (default ``os.environ``) chose one: what the command line
        and the app start from, before their own flags and settings."""
        env = os.environ if environ is None else environ
        return self if env.get("TRELLIS_DRAFT") else replace(self, draft=FRONT_END_DRAFT)

    def configure_kernels(self) -> None:
        """Make the process's kernels follow these options (the extension and its folders, GEMV
        split tuning)."""
        from engine import kernels

        kernels.configure(
            use_extension=self.use_extension,
            prebuilt_dir=self.extension_prebuilt_dir,
            cache_dir=self.extension_cache_dir,
            gemv_tuning=self.gemv_tuning,
        )


DEFAULT_OPTIONS = EngineOptions()
# Users' default drafter (engine.generation.speculative.factory): n-gram on the CPU, where it was
# measured never slower than plain decoding with the starter model (docs/SPECULATIVE.md).
FRONT_END_DRAFT = "auto"
