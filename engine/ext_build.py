"""Building and loading the CUDA extension (``ext/``): JIT with ``torch.utils.cpp_extension``.

The extension is compiled on first use for the GPU that is present (ninja, cached per torch
version, CUDA version and GPU architecture), or ahead of time with ``python -m engine build-ext``.
A prebuilt module (e.g. compiled on a machine with nvcc but no GPU, ``build-ext --arch 9.0
--export DIR``) is used instead when ``$TRELLIS_EXT_PREBUILT`` points at its directory and it
was built from the same sources for the same torch.

Nothing here runs at import time: :mod:`engine.ops` calls :func:`load` only when a CUDA tensor
reaches a fast path, so a CPU-only machine never tries to compile.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

EXT_DIR = Path(__file__).resolve().parents[1] / "ext"
MODULE_NAME = "trellis_ext"
# Sources compiled into the module; headers are hashed too (they change the build).
SOURCES = (
    "trellis_ext.cpp",
    "exl3_gemv_3inst.cu",
    "exl3_gemv_mcg.cu",
    "exl3_gemv_mul1.cu",
    "exl3_gemv_v5.cu",
    "exl3_misc.cu",
    "paged_attention.cu",
    "viterbi.cu",
    "fused_ops.cu",
    "quantized_cache_read.cu",
    "exl3_weight.cu",
    "sampling.cu",
    "argmax.cu",
)
HEADERS = (
    "trellis_ext.h",
    "chained_launch.cuh",
    "cluster_launch.cuh",
    "exl3_common.cuh",
    "exl3_gemv.cuh",
    "exl3_gemv_v5.cuh",
    "float_types.cuh",
    "hadamard.cuh",
)
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 with fp32 accumulation, cp.async-era GPUs
CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]


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


_info: BuildInfo | None = None


def sources_hash() -> str:
    """Hash of every source and header, so a prebuilt module is only used for the same code."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((EXT_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _torch():
    import torch  # local: keep `import engine.ext_build` cheap

    return torch


def detect_arch() -> str:
    """``major.minor`` of the current GPU, e.g. ``9.0``; raises when there is none or it is too old."""
    torch = _torch()
    if not torch.cuda.is_available():
        raise ExtensionUnavailable("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_CAPABILITY:
        raise ExtensionUnavailable(
            f"GPU compute capability {major}.{minor} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            "(the kernels need Ampere or newer)"
        )
    return f"{major}.{minor}"


def _default_cache_root() -> Path:
    env = os.environ.get("TRELLIS_EXT_CACHE")
    if env:
        return Path(env)
    try:
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("trellis-chat")) / "ext"
    except ImportError:  # platformdirs is a dependency, but keep the build usable without it
        return Path.home() / ".cache" / "trellis-chat" / "ext"


def build_dir(arch: str) -> Path:
    """Cache folder of one (torch, CUDA, architecture) combination."""
    torch = _torch()
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch.replace('.', '')}"
    return _default_cache_root() / tag


def check_toolchain() -> None:
    """Raise :class:`ExtensionUnavailable` with a clear message when nothing can be compiled."""
    torch = _torch()
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


def _load_prebuilt(arch: str | None) -> tuple[ModuleType, BuildInfo] | None:
    """The module under ``$TRELLIS_EXT_PREBUILT`` if it matches these sources and this torch."""
    root = os.environ.get("TRELLIS_EXT_PREBUILT")
    if not root:
        return None
    meta_path = Path(root) / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    torch = _torch()
    same = (
        meta.get("sources") == sources_hash()
        and meta.get("torch") == torch.__version__.split("+")[0]
        and meta.get("cuda") == torch.version.cuda
        and (arch is None or meta.get("arch") == arch)
    )
    if not same:
        print(
            f"trellis: prebuilt extension in {root} does not match (sources/torch/arch); building instead",
            file=sys.stderr,
        )
        return None
    t0 = time.perf_counter()
    module = _import_from(Path(root) / meta["file"], meta.get("name", MODULE_NAME))
    return module, BuildInfo(
        str(Path(root) / meta["file"]), root, meta["arch"], time.perf_counter() - t0, True
    )


def load(verbose: bool = False, arch: str | None = None, force: bool = False) -> ModuleType:
    """Build (if needed) and import the extension; raise :class:`ExtensionUnavailable` if impossible.

    ``arch`` (``"9.0"``) compiles for that architecture without looking at a GPU (to prebuild
    on a machine without one); by default the present GPU decides. ``force`` rebuilds from
    scratch. The build directory is reused, so a second call is only an import.
    """
    global _info
    if arch is None:
        arch = detect_arch()
    if not force:
        pre = _load_prebuilt(arch)
        if pre is not None:
            _info = pre[1]
            return pre[0]
    check_toolchain()
    from torch.utils import cpp_extension

    bdir = build_dir(arch)
    if force and bdir.exists():
        shutil.rmtree(bdir)
    bdir.mkdir(parents=True, exist_ok=True)
    # torch reads the target list from this variable; one architecture keeps the build short.
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
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
    torch = _torch()
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
