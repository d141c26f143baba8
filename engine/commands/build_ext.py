"""``build-ext``: compile the CUDA extension ahead of time and say how long it took and where it lives."""

from __future__ import annotations

import argparse
import sys
import time

from engine.commands.common import run_alone


def register(sub) -> None:
    p = sub.add_parser("build-ext", help="compile the CUDA extension (ext/) now instead of on first use")
    p.add_argument("--force", action="store_true", help="rebuild from scratch (drop the cached build)")
    p.add_argument(
        "--arch",
        default=None,
        help="compute capability to build for, e.g. 9.0 (default: the GPU present; needed without a GPU)",
    )
    p.add_argument(
        "--export",
        default=None,
        metavar="DIR",
        help="also copy the module + meta.json to DIR (use it elsewhere with TRELLIS_EXT_PREBUILT=DIR, "
        "EngineOptions.extension_prebuilt_dir)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.kernels import loader

    options = args.options
    t0 = time.perf_counter()
    try:
        arch = args.arch or loader.detect_arch()
        module = loader.load(
            verbose=args.verbose,
            arch=arch,
            force=args.force,
            prebuilt_dir=options.extension_prebuilt_dir,
            cache_dir=options.extension_cache_dir,
        )
    except loader.ExtensionUnavailable as exc:
        print(f"build-ext: cannot build the CUDA extension: {exc}", file=sys.stderr)
        print("build-ext: the engine still runs, on its torch reference path", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    info = loader.info()
    print(f"CUDA extension ready in {seconds:.1f} s (sm_{arch.replace('.', '')})")
    print(f"  module: {module.__file__}")
    if info is not None:
        print(f"  build directory: {info.build_dir}{' (prebuilt)' if info.prebuilt else ''}")
    if args.export:
        path = loader.export(module, args.export, arch)
        print(f"  exported: {path} (set TRELLIS_EXT_PREBUILT={args.export})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "build-ext", argv)


if __name__ == "__main__":
    raise SystemExit(main())
