"""Reading ``preprocessor_config.json``: the image processor settings a model ships with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import read_json


@dataclass
class ImageSettings:
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, directory: Path) -> ImageSettings:
        path = Path(directory) / "preprocessor_config.json"
        return cls(read_json(path) if path.exists() else {})

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    @property
    def rescale_factor(self) -> float:
        return float(self.get("rescale_factor", 1 / 255))

    @property
    def do_normalize(self) -> bool:
        return bool(self.get("do_normalize", True))

    def mean_std(self, mean: list[float], std: list[float]) -> tuple[list[float], list[float]]:
        return list(self.get("image_mean", mean)), list(self.get("image_std", std))

    def resample(self, default: int) -> int:
        return int(self.get("resample", default))
