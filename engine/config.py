"""Reading a Hugging Face model directory's configuration files.

``config.json`` describes the network, ``generation_config.json`` the defaults for generating
(EOS ids above all) and ``quantization_config`` (inside config.json, or its own file for EXL3)
how the weights are stored. This module only reads and validates them; what the fields mean for
the maths is decided by ``engine.architectures``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, ModelNotFoundError


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path`` with an error that names the file on failure."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path.name} is missing from {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data


def require_model_dir(directory: str | Path) -> Path:
    """``directory`` as a Path, checked to be an existing folder. Loaders call it before reading
    any file inside, so a mistyped path is reported as such, not as a file missing from it."""
    directory = Path(directory)
    if not directory.exists():
        raise ModelNotFoundError(f"model directory {directory} does not exist")
    if not directory.is_dir():
        raise ModelLoadError(f"{directory} is a file, not a model directory")
    return directory


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ModelConfig:
    """The configuration of one model directory.

    ``text`` is the language model's part of config.json: for multimodal checkpoints that nest it
    under ``text_config`` it is that dictionary with the top-level fields it lacks filled in.
    """

    directory: Path
    architecture: str
    raw: dict[str, Any]
    text: dict[str, Any]
    generation: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelConfig:
        directory = require_model_dir(directory)
        raw = read_json(directory / "config.json")
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelLoadError(
                f"{directory / 'config.json'} names no architecture ('architectures' is empty)"
            )
        text = dict(raw.get("text_config") or raw)
        for key, value in raw.items():
            if key != "text_config":
                text.setdefault(key, value)
        gen_path = directory / "generation_config.json"
        generation = read_json(gen_path) if gen_path.exists() else {}
        quant = raw.get("quantization_config")
        quant_path = directory / "quantization_config.json"
        if quant_path.exists():
            quant = {**(quant or {}), **read_json(quant_path)}
        return cls(directory, archs[0], raw, text, generation, quant)

    def get(self, key: str, default: Any = None) -> Any:
        """A field of the language model's config; ``None`` values count as missing."""
        value = self.text.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.text.get(key)
        if value is None:
            raise ModelLoadError(f"{self.directory / 'config.json'} lacks required field '{key}'")
        return value

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json, then config.json (both may list several)."""
        ids = _as_id_list(self.generation.get("eos_token_id"))
        for i in _as_id_list(self.text.get("eos_token_id")):
            if i not in ids:
                ids.append(i)
        return ids

    @property
    def bos_token_id(self) -> int | None:
        value = self.generation.get("bos_token_id", self.text.get("bos_token_id"))
        return int(value) if isinstance(value, int) else None

    @property
    def context_length(self) -> int:
        return int(self.get("max_position_embeddings", 4096))
