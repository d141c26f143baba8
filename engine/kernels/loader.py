"""The CUDA extension (``ext/``): building it, loading it, and the process-wide settings of its use.

A prebuilt module is used first where one fits exactly (the same sources, torch version, CUDA
version and Python, with code for the GPU present; :mod:`engine.kernels.prebuilt` says where they
are looked for: the configured folder, the managed GPU runtime beside torch, the package). Else
the extension is compiled on first use for the GPU that is present (JIT with
``torch.utils.cpp_extension``, ninja, cached per torch version, CUDA version and GPU architecture),
where a CUDA toolkit exists, or ahead of time with ``python -m engine build-ext``. Else the
callers run their torch paths, and :func:`status` gives the reason (including why each prebuilt
module found did not fit).

Nothing here runs at import time, and nothing reads the environment: the settings
(:func:`configure`) come from the caller's ``EngineOptions``. The extension is built or loaded by
the first :func:`extension` call that sees a CUDA tensor, never on a CPU-only machine; where it
cannot be had (no toolkit, old GPU, build error, turned off) the engine says so once on stderr and
the callers run their torch paths.

There is one extension per process, so its settings are per process too; so is the switch of
chained launches (:func:`chained_launches`), which the extension holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine.kernels import prebuilt

EXT_DIR = Path(__file__).resolve().parents[2] / "ext"
# The hash of the sources a package's prebuilt modules were built from, where ext/ is not installed.
SOURCES_STAMP = prebuilt.PACKAGE_DIR / "SOURCES"
MODULE_NAME = "trellis_ext"
# Sources compiled into the module; headers are hashed too (they change the build).
SOURCES = (
    "trellis_ext.cpp",
    "exl3_gemv_3inst.cu",
    "exl3_gemv_mcg.cu",
    "exl3_gemv_mul1.cu",
    "exl3_gemv_cluster.cu",
    "paged_attention.cu",
    "viterbi.cu",
    "fused_ops.cu",
    "recurrent_step.cu",
    "recurrent_scan.cu",
    "quantized_cache_read.cu",
    "exl3_weight.cu",
    "sampling.cu",
    "argmax.cu",
    "exl3_expert_gemv.cu",
    "moe_route.cu",
)
HEADERS = (
    "trellis_ext.h",
    "activations.cuh",
    "chained_launch.cuh",
    "cluster_launch.cuh",
    "exl3_common.cuh",
    "exl3_gemv.cuh",
    "exl3_gemv_cluster.cuh",
    "float_types.cuh",
    "hadamard.cuh",
)
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 with fp32 accumulation, cp.async-era GPUs
CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]

# The extension's numbering of the EXL3 codebooks, and the dtypes its kernels take.
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ExtensionUnavailable(RuntimeError):
    """The CUDA extension cannot be built or loaded here; the message says why (for users)."""


@dataclass
class BuildInfo:
    """Where the loaded module came from, for ``build-ext`` and diagnostics."""

    module_path: str
    build_dir: str
    arch: str
    seconds: float
    prebuilt: bool


@dataclass(frozen=True)
class Settings:
    """How this process gets its extension: whether at all, a prebuilt module's folder, and the
    folder of JIT builds (None: the user cache folder)."""

    enabled: bool = True
    prebuilt_dir: Path | None = None
    cache_dir: Path | None = None


_settings = Settings()
_ext: ModuleType | None = None
_tried = False
_reason = "not loaded yet"
_info: BuildInfo | None = None


# -- building -----------------------------------------------------------------------------


def sources_hash() -> str:
    """Hash of every source and header, so a prebuilt module is only used for the same code.

    From ``ext/`` where the sources are (a checkout); in an installed wheel or the bundle, which
    carry no ``ext/``, from the stamp their build wrote (:func:`write_sources_stamp`)."""
    if not EXT_DIR.is_dir():
        if SOURCES_STAMP.is_file():
            return SOURCES_STAMP.read_text().strip()
        raise ExtensionUnavailable(
            f"neither the CUDA extension's sources ({EXT_DIR}) nor the stamp of those its prebuilt "
            f"modules were built from ({SOURCES_STAMP}) is installed"
        )
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((EXT_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def write_sources_stamp() -> Path:
    """Record the hash of ``ext/`` in the package (:data:`SOURCES_STAMP`), for an install without
    the sources to match prebuilt modules by (packaging/build_bundle.sh and
    packaging/build_prebuilt_ext.py write it)."""
    SOURCES_STAMP.write_text(sources_hash() + "\n")
    return SOURCES_STAMP


def detect_arch() -> str:
    """``major.minor`` of the current GPU, e.g. ``9.0``; raises when there is none or it is too old."""
    if not torch.cuda.is_available():
        raise ExtensionUnavailable("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_CAPABILITY:
        raise ExtensionUnavailable(
            f"GPU compute capability {major}.{minor} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            "(the kernels need Ampere or newer)"
        )
    return f"{major}.{minor}"


def default_cache_root() -> Path:
    """The user cache folder of JIT builds."""
    try:
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("trellis-chat")) / "ext"
    except ImportError:  # platformdirs is a dependency, but keep the build usable without it
        return Path.home() / ".cache" / "trellis-chat" / "ext"


def build_dir(arch: str, cache_dir: str | Path | None = None) -> Path:
    """Folder of one (torch, CUDA, architecture) combination under ``cache_dir`` (None: the user
    cache folder)."""
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch.replace('.', '')}"
    return (Path(cache_dir) if cache_dir is not None else default_cache_root()) / tag


def needs_compile(bdir: Path, sources: list[Path] | None = None) -> bool:
    """Whether a JIT build in ``bdir`` will compile: no module there yet, or a source or header
    (default: ``ext/``'s) newer than it (ninja's own rule, which decides in the end)."""
    built = [p for p in (bdir / f"{MODULE_NAME}.so", bdir / f"{MODULE_NAME}.pyd") if p.is_file()]
    if not built:
        return True
    if sources is None:
        sources = [EXT_DIR / name for name in (*SOURCES, *HEADERS)]
    made = max(p.stat().st_mtime for p in built)
    return any(s.stat().st_mtime > made for s in sources if s.is_file())


def check_toolchain() -> None:
    """Raise :class:`ExtensionUnavailable` with a clear message when nothing can be compiled."""
    if torch.version.cuda is None:
        raise ExtensionUnavailable(f"this torch build ({torch.__version__}) has no CUDA support")
    from torch.utils import cpp_extension

    if (
        cpp_extension.CUDA_HOME is None
        or shutil.which("nvcc", path=str(Path(cpp_extension.CUDA_HOME) / "bin")) is None
    ):
        raise ExtensionUnavailable(
            "no CUDA toolkit found (nvcc); install the CUDA toolkit matching torch "
            f"(CUDA {torch.version.cuda}) and set CUDA_HOME"
        )
    if not cpp_extension.is_ninja_available():
        raise ExtensionUnavailable("ninja is not installed (pip install ninja)")


def _import_from(path: Path, name: str) -> ModuleType:
    # ``name`` must be the one compiled in (PyInit_<name>); torch's JIT may have versioned it.
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExtensionUnavailable(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def current_target(arch: str) -> prebuilt.Target:
    """What a prebuilt module must match in this process, for a GPU of ``arch``."""
    return prebuilt.Target(
        sources=sources_hash(),
        torch=torch.__version__.split("+")[0],
        cuda=torch.version.cuda,
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        arch=arch,
    )


def _load_manifest(manifest: prebuilt.Manifest) -> tuple[ModuleType, BuildInfo]:
    t0 = time.perf_counter()
    try:
        module = _import_from(manifest.module, manifest.name)
    except (ImportError, OSError) as exc:
        raise ExtensionUnavailable(f"prebuilt extension {manifest.module} does not load: {exc}") from exc
    arch = ",".join(manifest.archs)
    return module, BuildInfo(
        str(manifest.module), str(manifest.path.parent), arch, time.perf_counter() - t0, True
    )


def find_prebuilt(configured: str | Path | None, arch: str) -> tuple[prebuilt.Manifest | None, list[str]]:
    """The prebuilt module that fits this process for a GPU of ``arch`` (see
    :mod:`engine.kernels.prebuilt` for the folders), and why each other one found does not."""
    torch_dir = Path(torch.__file__).resolve().parent
    dirs = prebuilt.search_dirs(Path(configured) if configured else None, torch_dir)
    return prebuilt.find(dirs, current_target(arch))


def load_prebuilt(root: str | Path | None, arch: str | None) -> tuple[ModuleType, BuildInfo] | None:
    """The module in the folder ``root`` if one there fits these sources, this torch and
    ``arch`` (None: the GPU present)."""
    if not root:
        return None
    manifest, reasons = prebuilt.find([Path(root)], current_target(arch or detect_arch()))
    if manifest is None:
        if reasons:
            print(
                f"trellis: prebuilt extension in {root} does not match ({'; '.join(reasons)})",
                file=sys.stderr,
            )
        return None
    return _load_manifest(manifest)


def load(
    verbose: bool = False,
    arch: str | None = None,
    force: bool = False,
    prebuilt_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> ModuleType:
    """Build (if needed) and import the extension; raise :class:`ExtensionUnavailable` if impossible.

    ``arch`` (``"9.0"``) compiles for that architecture without looking at a GPU (to prebuild
    on a machine without one); by default the present GPU decides. ``force`` rebuilds from
    scratch (no prebuilt module). ``prebuilt_dir``: a folder of prebuilt modules looked in
    first (:func:`find_prebuilt`). ``cache_dir``: the folder of JIT builds (None: the user cache
    folder); the build directory is reused, so a second call is only an import.
    """
    global _info
    if arch is None:
        arch = detect_arch()
    passed_over: list[str] = []
    if not force:
        manifest, passed_over = find_prebuilt(prebuilt_dir, arch)
        if manifest is not None:
            try:
                module, _info = _load_manifest(manifest)
                return module
            except ExtensionUnavailable as exc:
                passed_over.append(str(exc))
    try:
        check_toolchain()
        if not EXT_DIR.is_dir():
            raise ExtensionUnavailable(f"the CUDA extension's sources ({EXT_DIR}) are not installed")
    except ExtensionUnavailable as exc:
        target = current_target(arch)
        found = "; ".join(passed_over) if passed_over else "none found"
        raise ExtensionUnavailable(
            f"{exc}; and no prebuilt extension fits torch {target.torch}, CUDA {target.cuda}, "
            f"sm_{arch.replace('.', '')} ({found})"
        ) from exc
    from torch.utils import cpp_extension

    bdir = build_dir(arch, cache_dir)
    if force and bdir.exists():
        shutil.rmtree(bdir)
    bdir.mkdir(parents=True, exist_ok=True)
    # torch reads the target list from this variable; one architecture keeps the build short.
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    if needs_compile(bdir):  # minutes of silence otherwise, in whatever asked for a kernel
        print(
            f"trellis: compiling the CUDA extension for sm_{arch.replace('.', '')} in {bdir} "
            "(once per install, update or GPU; several minutes)",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=MODULE_NAME,
            sources=[str(EXT_DIR / s) for s in SOURCES],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=CUDA_FLAGS,
            extra_include_paths=[str(EXT_DIR)],
            build_directory=str(bdir),
            verbose=verbose,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError/OSError/ImportError
        raise ExtensionUnavailable(f"building the CUDA extension failed: {exc}") from exc
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old
    _info = BuildInfo(str(module.__file__), str(bdir), arch, time.perf_counter() - t0, False)
    return module


def export(module: ModuleType, dest: str | Path, arch: str) -> Path:
    """Copy a built module to ``dest`` with a ``meta.json`` that :func:`load` checks before use."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    src = Path(module.__file__)
    shutil.copy2(src, dest / src.name)
    meta = {
        "file": src.name,
        "name": module.__name__,
        "sources": sources_hash(),
        "torch": torch.__version__.split("+")[0],
        "cuda": torch.version.cuda,
        "arch": arch,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    (dest / "meta.json").write_text(json.dumps(meta, indent=2))
    return dest / src.name


def info() -> BuildInfo | None:
    """How the extension was obtained in this process (None if it was not loaded)."""
    return _info


# -- the process's extension ----------------------------------------------------------------


def settings() -> Settings:
    """The settings :func:`extension` follows."""
    return _settings


def configure(
    enabled: bool = True, prebuilt_dir: str | Path | None = None, cache_dir: str | Path | None = None
) -> bool:
    """Set how :func:`extension` gets the module; True when that changed (the caller then resets
    what was loaded under the old settings)."""
    global _settings
    new = Settings(
        enabled,
        Path(prebuilt_dir) if prebuilt_dir is not None else None,
        Path(cache_dir) if cache_dir is not None else None,
    )
    changed = new != _settings
    _settings = new
    return changed


def extension() -> ModuleType | None:
    """The CUDA extension (built/loaded on first call), or None where it is not available."""
    global _ext, _tried, _reason
    if _tried:
        return _ext
    _tried = True
    if not _settings.enabled:
        _reason = "turned off (EngineOptions.use_extension)"
        return None
    if not torch.cuda.is_available():
        _reason = "no CUDA GPU"  # the normal CPU case: nothing to say
        return None
    try:
        _ext = load(prebuilt_dir=_settings.prebuilt_dir, cache_dir=_settings.cache_dir)
        _reason = "loaded"
    except ExtensionUnavailable as exc:
        _reason = str(exc)
        print(f"trellis: CUDA extension unavailable ({exc}); using the torch reference path", file=sys.stderr)
    return _ext


def status() -> dict[str, Any]:
    """Whether the extension is in use and why not (after :func:`extension` was called)."""
    built = info()
    return {
        "available": _ext is not None,
        "reason": _reason,
        "module": built.module_path if built else None,
        "build_seconds": built.seconds if built else None,
        "prebuilt": built.prebuilt if built else None,
    }


def reset() -> None:
    """Forget the loaded extension so the next call tries again (tests, ``build-ext``)."""
    global _ext, _tried, _reason
    _ext, _tried, _reason = None, False, "not loaded yet"


def kernel_ready(*tensors: torch.Tensor) -> ModuleType | None:
    """The extension where a kernel may take ``tensors``: all on a GPU, and none that autograd
    must see through (the kernels have no backward; the converter's scale tuning,
    engine.convert.finetune, takes the torch path). Else None."""
    if not all(t.is_cuda for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return extension()


# -- chained launches -------------------------------------------------------------------------


def chained_launches_supported(device: torch.device) -> bool:
    """True where :func:`chained_launches` turns chaining on: a GPU of sm_90 or newer (programmatic
    dependent launch) and the extension. Elsewhere the kernels launch the usual way, which is
    always correct: the chained kernels' waits are no-ops then."""
    if device.type != "cuda":
        return False
    ext = extension()
    if ext is None or not hasattr(ext, "set_chained_launches"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def chained_launches(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Within the block, the decode-step kernels on ``device`` launch chained (ext/chained_launch.cuh:
    each launches while the previous one still runs and waits for it before it reads or writes
    anything but weights, so a GEMV fetches its first weight rows during the previous kernel;
    +9% on the 8B shape, docs/KERNELS.md section 9). Only valid where no kernel writes a weight
    the chain reads: a loaded model's decode step.

    A no-op on CPU, before sm_90 and without the extension; ``enabled=False`` turns chaining off
    inside an enclosing block (timing fresh weight copies). The switch is per process: the
    previous setting is restored on exit.
    """
    if not chained_launches_supported(device):
        yield
        return
    ext = extension()
    previous = ext.set_chained_launches(enabled)
    try:
        yield
    finally:
        ext.set_chained_launches(previous)
