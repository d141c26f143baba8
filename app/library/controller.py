"""Which folders the library looks in, keeping the library model in step with them, the load
options (context length and memory) every load and estimate uses, and deleting a model."""

from __future__ import annotations

import shutil
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.library.load_context import load_context
from app.library.model import LibraryModel
from app.library.scanner import is_usable_model_dir, scan, split_models
from app.settings.settings import Settings
from engine.inspect import ModelInfo, inspect_model, likely_device
from engine.staging import remove_stale_staging


class LibraryController(QObject):
    foldersChanged = Signal(list)
    refreshed = Signal()
    notModelsChanged = Signal(list)  # [(folder, why it is not a model)]

    def __init__(
        self, settings: Settings, models_dir: Path, model: LibraryModel, parent: QObject | None = None
    ):
        super().__init__(parent)
        self.settings = settings
        self.models_dir = Path(models_dir)
        self.model = model
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.not_models: list[tuple[str, str]] = []
        # Startup is when an import killed last session can be reclaimed (hundreds of MB, hidden).
        # Only the app's own folder: the user's folders are theirs to tidy.
        remove_stale_staging(self.models_dir)

    def folders(self) -> list[Path]:
        """The app's own models folder first, then the user's."""
        return [self.models_dir] + [Path(p) for p in self.settings.get("library.folders")]

    def add_folder(self, folder: str | Path) -> ModelInfo | None:
        """Add a folder; returns the model's info if the folder is itself a model (so the caller
        can say why it cannot load)."""
        folder = Path(folder)
        extra = self.settings.get("library.folders")
        if str(folder) not in extra and folder != self.models_dir:
            self.settings.set("library.folders", [*extra, str(folder)])
            self.foldersChanged.emit([str(p) for p in self.folders()])
        self.refresh()
        row = self.model.row_of(str(folder))
        return self.model.infos()[row] if row >= 0 else None

    def remove_folder(self, folder: str | Path) -> None:
        extra = [p for p in self.settings.get("library.folders") if p != str(folder)]
        self.settings.set("library.folders", extra)
        self.foldersChanged.emit([str(p) for p in self.folders()])
        self.refresh()

    def refresh(self) -> None:
        self._estimate_assumptions()
        models, others = split_models(scan(self.folders()))
        self.model.set_models(models)
        self.not_models = [(str(info.path), why) for info, why in others]
        self.notModelsChanged.emit(self.not_models)
        self.refreshed.emit()

    def refresh_estimates(self) -> None:
        """The settings an estimate depends on changed: recompute, without rescanning folders."""
        self._estimate_assumptions()
        self.model.refresh_estimates()

    def cache_bits(self) -> tuple[int, int]:
        """The KV cache's (key bits, value bits) the user chose; 16 means unquantized."""
        return int(self.settings.get("engine.cache_bits_k")), int(self.settings.get("engine.cache_bits_v"))

    def set_cache_bits(self, key_bits: int, value_bits: int) -> None:
        self.settings.set("engine.cache_bits_k", key_bits)
        self.settings.set("engine.cache_bits_v", value_bits)

    def context_limit(self) -> int:
        """The context length the user chose (a model with less is loaded with its own)."""
        return int(self.settings.get("engine.context_length"))

    def set_context_limit(self, tokens: int) -> None:
        self.settings.set("engine.context_length", tokens)

    def load_context(self, info: ModelInfo) -> int:
        """Tokens of context the model of ``info`` is loaded with: what a load asks the engine
        for, and what the library's estimate is for."""
        return load_context(info.context_length, self.context_limit())

    def delete_model(self, path: str | Path) -> None:
        """Delete a model's folder from disk (the caller has asked the user) and forget it.
        Refuses anything the library does not list as a model, and the app's models folder."""
        folder = Path(path)
        if self.model.row_of(str(folder)) < 0 or not is_usable_model_dir(folder):
            raise ValueError(f"{folder} is not a model folder of the library")
        if folder.resolve() == self.models_dir.resolve():
            raise ValueError("the app's models folder itself cannot be deleted")
        shutil.rmtree(folder)
        extra = self.settings.get("library.folders")
        if str(folder) in extra:  # it was added as a folder of its own
            self.settings.set("library.folders", [p for p in extra if p != str(folder)])
            self.foldersChanged.emit([str(p) for p in self.folders()])
        self.refresh()

    def _estimate_assumptions(self) -> None:
        self.model.context_limit = self.context_limit()
        self.model.device = likely_device(self.settings.get("engine.device"))
        self.model.cache_bits = self.cache_bits()

    def is_empty(self) -> bool:
        return self.model.rowCount() == 0

    def info_for(self, path: str | Path) -> ModelInfo:
        row = self.model.row_of(str(path))
        return self.model.infos()[row] if row >= 0 else inspect_model(path)
