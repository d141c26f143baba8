"""Finding models on disk (no Qt): a folder is either a model itself or holds model folders.

A folder can look like a model (it has .safetensors files) and be none: a LoRA adapter, a folder
of codebook tables, a config.json with no architecture. Such folders are not listed as models
(a row of unknowns that can never load); ``not_a_model`` says why, and the library lists them
apart, dimmed, so the user knows they were seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.hub.library import PARTIAL_DIR, is_complete
from engine.inspect import ModelInfo, inspect_model, looks_like_model_dir
from engine.staging import is_staging_dir


def is_usable_model_dir(path: Path) -> bool:
    """A model folder, and not one a download is still writing into (nothing half-downloaded is
    shown as usable: a download in progress keeps its parts under ``PARTIAL_DIR``) nor an import's
    staging folder (live or abandoned, it holds a config.json and weights but is no model yet)."""
    if is_staging_dir(path) or not looks_like_model_dir(path):
        return False
    return not (path / PARTIAL_DIR).exists() or is_complete(path)


def model_dirs(folder: Path) -> list[Path]:
    """``folder`` itself if it is a model, else its direct subfolders that look like models."""
    if not folder.is_dir():
        return []
    if looks_like_model_dir(folder):
        return [folder] if is_usable_model_dir(folder) else []
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    return [p for p in children if is_usable_model_dir(p)]


def not_a_model(info: ModelInfo) -> str | None:
    """Why ``info``'s folder is no model at all (None: it is one, loadable or not)."""
    if info.quantization == "GGUF" or info.architecture or info.model_type:
        return None  # a model (a GGUF needs importing; a broken one says why it cannot load)
    if not (info.path / "config.json").is_file():
        return "weights without a config.json"
    return "a config.json that names no model architecture"


def split_models(infos: Iterable[ModelInfo]) -> tuple[list[ModelInfo], list[tuple[ModelInfo, str]]]:
    """(models, [(folder that is not a model, why)]) in the order found."""
    models: list[ModelInfo] = []
    others: list[tuple[ModelInfo, str]] = []
    for info in infos:
        reason = not_a_model(info)
        if reason is None:
            models.append(info)
        else:
            others.append((info, reason))
    return models, others


def scan(folders: Iterable[Path]) -> list[ModelInfo]:
    """Inspect every model under ``folders`` (duplicates removed, order kept)."""
    seen: set[Path] = set()
    found: list[ModelInfo] = []
    for folder in folders:
        for path in model_dirs(Path(folder)):
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                found.append(inspect_model(path))
    return found
