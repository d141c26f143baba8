"""The text of special tokens, read from a model directory's ``tokenizer.json``.

Vision models are built with the weights, before (and without) the tokenizer; they need the
text of their image tokens to write placeholders into a rendered prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from engine.errors import ModelLoadError


def special_token_text(directory: Path) -> Callable[[int], str]:
    """``text(id)`` for the added tokens of the tokenizer in ``directory``."""
    path = Path(directory) / "tokenizer.json"
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read the image tokens: {exc}") from None
    table = {int(t["id"]): t["content"] for t in added}

    def text(token_id: int) -> str:
        if token_id not in table:
            raise ModelLoadError(
                f"{path} has no special token with id {token_id} (an image token of the model)"
            )
        return table[token_id]

    return text


def special_token_id(directory: Path, content: str) -> int | None:
    path = Path(directory) / "tokenizer.json"
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
    for t in added:
        if t["content"] == content:
            return int(t["id"])
    return None
