"""Prebuilt CUDA extension modules: their manifests, where they are looked for, and whether one
fits this process.

A prebuilt module is compiled ahead of time for several GPU generations at once
(``packaging/build_prebuilt_ext.py``) and stored as a pair::

    trellis_ext-<torch>-cu<cuda>.so     the module (PyInit_trellis_ext)
    trellis_ext-<torch>-cu<cuda>.json   its manifest: sources hash, torch, CUDA, Python, archs

``python -m engine build-ext --export DIR`` writes the older single-GPU form, ``meta.json`` with
one ``arch``; both are read here. Folders searched, first match wins: the configured one
(``EngineOptions.extension_prebuilt_dir``), ``trellis_ext_prebuilt/`` next to the torch package
(where the app's managed GPU runtime unpacks the binaries of its torch build), and
``engine/kernels/prebuilt/`` (shipped in the wheel).

A module is used only when it was built from these sources, for this torch version, this CUDA
version and this Python, and has code for the GPU: machine code for the same generation at or
below its minor version (an sm_80 binary runs on sm_86 and sm_87; an sm_90 one does not run on
sm_100). No torch import here: the build script and the tests use it without a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODULE_NAME = "trellis_ext"
PACKAGE_DIR = Path(__file__).resolve().parent / "prebuilt"
RUNTIME_DIR_NAME = "trellis_ext_prebuilt"  # beside the torch package in a site-packages folder
LEGACY_MANIFEST = "meta.json"


@dataclass(frozen=True)
class Target:
    """What a prebuilt module must have been built for to load in this process."""

    sources: str  # engine.kernels.loader.sources_hash()
    torch: str  # without the local suffix: 2.13.0
    cuda: str | None  # torch.version.cuda; None for a CPU build
    python: str  # 3.11
    arch: str  # the GPU's compute capability: 8.9


@dataclass(frozen=True)
class Manifest:
    path: Path  # the manifest file
    module: Path  # the module it describes
    name: str
    sources: str
    torch: str
    cuda: str
    python: str | None
    archs: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Raises ValueError for a manifest that is not one."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            archs = data["archs"] if "archs" in data else [data["arch"]]
            return cls(
                path=Path(path),
                module=Path(path).parent / str(data["file"]),
                name=str(data.get("name", MODULE_NAME)),
                sources=str(data["sources"]),
                torch=str(data["torch"]),
                cuda=str(data["cuda"]),
                python=data.get("python"),
                archs=tuple(str(a) for a in archs),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a prebuilt-extension manifest ({exc})") from exc


def artifact_stem(torch_version: str, cuda: str) -> str:
    """``trellis_ext-2.13.0-cu128``: the file names of one (torch, CUDA) build."""
    return f"{MODULE_NAME}-{torch_version}-cu{cuda.replace('.', '')}"


def manifest_json(
    module_file: str, sources: str, torch_version: str, cuda: str, python: str, archs: list[str]
) -> dict[str, Any]:
    return {
        "file": module_file,
        "name": MODULE_NAME,
        "sources": sources,
        "torch": torch_version,
        "cuda": cuda,
        "python": python,
        "archs": archs,
    }


def _capability(arch: str) -> tuple[int, int]:
    major, _, minor = arch.partition(".")
    return int(major), int(minor or 0)


def arch_covered(archs: tuple[str, ...], arch: str) -> bool:
    """Whether machine code for one of ``archs`` runs on a GPU of ``arch``."""
    major, minor = _capability(arch)
    for built in archs:
        try:
            b_major, b_minor = _capability(built)
        except ValueError:
            continue
        if b_major == major and b_minor <= minor:
            return True
    return False


def mismatch(manifest: Manifest, target: Target) -> str | None:
    """Why ``manifest``'s module cannot load here (None: it can)."""
    where = manifest.path.name
    if manifest.sources != target.sources:
        return f"{where}: built from other extension sources"
    if manifest.torch != target.torch:
        return f"{where}: built for torch {manifest.torch}, this is {target.torch}"
    if manifest.cuda != target.cuda:
        return f"{where}: built for CUDA {manifest.cuda}, this torch has CUDA {target.cuda}"
    if manifest.python is not None and manifest.python != target.python:
        return f"{where}: built for Python {manifest.python}, this is {target.python}"
    if not arch_covered(manifest.archs, target.arch):
        built = ", ".join(f"sm_{a.replace('.', '')}" for a in manifest.archs)
        return f"{where}: no code for this GPU (sm_{target.arch.replace('.', '')}); it has {built}"
    if not manifest.module.is_file():
        return f"{where}: its module {manifest.module.name} is missing"
    return None


def search_dirs(configured: Path | None, torch_dir: Path | None) -> list[Path]:
    """The folders looked in, in order; ``torch_dir`` is the torch package's folder."""
    dirs = [configured] if configured is not None else []
    if torch_dir is not None:
        dirs.append(Path(torch_dir).parent / RUNTIME_DIR_NAME)
    dirs.append(PACKAGE_DIR)
    unique: list[Path] = []
    for d in dirs:
        if Path(d) not in unique:
            unique.append(Path(d))
    return unique


def manifests_in(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = sorted(folder.glob(f"{MODULE_NAME}-*.json"))
    legacy = folder / LEGACY_MANIFEST
    return found + ([legacy] if legacy.is_file() else [])


def find(dirs: list[Path], target: Target) -> tuple[Manifest | None, list[str]]:
    """The first manifest in ``dirs`` whose module fits ``target``, and why each other one does
    not (for ``kernels.status()`` when none fits)."""
    reasons: list[str] = []
    for folder in dirs:
        for path in manifests_in(folder):
            try:
                manifest = Manifest.read(path)
            except ValueError as exc:
                reasons.append(str(exc))
                continue
            problem = mismatch(manifest, target)
            if problem is None:
                return manifest, reasons
            reasons.append(f"{folder}/{problem}")
    return None, reasons
