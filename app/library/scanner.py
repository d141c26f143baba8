"""Finding models on disk (no Qt): a folder is either a model itself or holds model folders."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.inspect import ModelInfo, inspect_model, looks_like_model_dir


def model_dirs(folder: Path) -> list[Path]:
    """``folder`` itself if it is a model, else its direct subfolders that look like models."""
    if not folder.is_dir():
        return []
    if looks_like_model_dir(folder):
        return [folder]
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    return [p for p in children if looks_like_model_dir(p)]


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
