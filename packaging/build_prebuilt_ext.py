#!/usr/bin/env python3
"""Build the CUDA extension (ext/) ahead of time for every supported GPU generation at once.

    python packaging/build_prebuilt_ext.py --out dist/prebuilt            # sm_80/86/89/90/100/120
    python packaging/build_prebuilt_ext.py --into-package                 # engine/kernels/prebuilt/
    python packaging/build_prebuilt_ext.py --out dist/prebuilt --zip      # + a zip for a runtime lock

Needs the CUDA build of torch that the module is for (its version and CUDA version are part of
the module's identity) and the matching CUDA toolkit (nvcc); no GPU. Compiles with
``torch.utils.cpp_extension.CUDAExtension`` through setuptools (ahead of time, not the JIT), then
writes ``trellis_ext-<torch>-cu<cuda>.so`` and its manifest (``engine.kernels.prebuilt``). The
``--zip`` archive holds them under ``trellis_ext_prebuilt/``, which the managed GPU runtime
unpacks beside torch (add it to the lock with ``make_runtime_lock.py --extension``).

Compiling six architectures takes a long time (about an hour on a few cores); ``--arch 9.0``
builds one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCHS = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
NEEDS_CUDA_12_8 = ("10.0", "12.0")  # Blackwell: nvcc knows these from CUDA 12.8 on


def archs_for(cuda: str, wanted: tuple[str, ...] = ARCHS) -> tuple[str, ...]:
    """The architectures of ``wanted`` that CUDA ``cuda``'s nvcc can compile for."""
    major, minor = (int(x) for x in cuda.split(".")[:2])
    if (major, minor) >= (12, 8):
        return wanted
    return tuple(a for a in wanted if a not in NEEDS_CUDA_12_8)


def cuda_torch_or_exit():
    """torch, if it is a CUDA build; else exit with what to install."""
    import torch

    if torch.version.cuda is None:
        raise SystemExit(
            f"build_prebuilt_ext: this torch ({torch.__version__}) is a CPU build; the extension is "
            "compiled against the CUDA build it will run with. Install that one first, e.g.\n"
            "  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128\n"
            "and the matching CUDA toolkit (nvcc), then run this again."
        )
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise SystemExit(
            f"build_prebuilt_ext: no CUDA toolkit found; install CUDA {torch.version.cuda} and set CUDA_HOME"
        )
    return torch


def build(out: Path, archs: tuple[str, ...], verbose: bool) -> tuple[Path, Path]:
    torch = cuda_torch_or_exit()
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    from engine.kernels import loader, prebuilt

    cuda = torch.version.cuda
    torch_version = torch.__version__.split("+")[0]
    usable = archs_for(cuda, archs)
    if not usable:
        raise SystemExit(f"build_prebuilt_ext: CUDA {cuda} cannot compile for {', '.join(archs)}")
    ext = CUDAExtension(
        name=prebuilt.MODULE_NAME,
        sources=[str(loader.EXT_DIR / s) for s in loader.SOURCES],
        include_dirs=[str(loader.EXT_DIR)],
        extra_compile_args={"cxx": loader.CXX_FLAGS, "nvcc": loader.CUDA_FLAGS},
    )
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(usable)  # what CUDAExtension compiles for
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        setup(
            name="trellis-ext-prebuilt",
            ext_modules=[ext],
            cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
            script_args=["build_ext", "--build-lib", tmp, "--build-temp", str(Path(tmp) / "obj"),
                         *([] if verbose else ["--quiet"])],
        )  # fmt: skip
        built = next(Path(tmp).glob(f"{prebuilt.MODULE_NAME}*.so"))
        stem = prebuilt.artifact_stem(torch_version, cuda)
        module = out / f"{stem}.so"
        shutil.copy2(built, module)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = out / f"{stem}.json"
    meta = prebuilt.manifest_json(
        module.name, loader.sources_hash(), torch_version, cuda, python, list(usable)
    )
    manifest.write_text(json.dumps(meta, indent=2) + "\n")
    names = ", ".join("sm_" + a.replace(".", "") for a in usable)
    size = module.stat().st_size / 2**20
    print(f"{module} ({size:.1f} MiB) for {names} in {time.perf_counter() - t0:.0f} s")
    return module, manifest


def make_zip(module: Path, manifest: Path) -> Path:
    from engine.kernels import prebuilt

    archive = module.with_suffix(".zip")
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in (module, manifest):
            zf.write(path, f"{prebuilt.RUNTIME_DIR_NAME}/{path.name}")
    return archive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "dist" / "prebuilt")
    p.add_argument(
        "--into-package", action="store_true", help="write into engine/kernels/prebuilt/ (the wheel)"
    )
    p.add_argument("--arch", action="append", help=f"an architecture to build (default: {' '.join(ARCHS)})")
    p.add_argument("--zip", action="store_true", help="also write a zip for the GPU runtime's lock")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    from engine.kernels import prebuilt

    out = prebuilt.PACKAGE_DIR if args.into_package else args.out
    module, manifest = build(out, tuple(args.arch or ARCHS), args.verbose)
    if args.into_package:
        from engine.kernels import loader

        loader.write_sources_stamp()  # the wheel has no ext/: it matches modules by this
    if args.zip:
        print(make_zip(module, manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
