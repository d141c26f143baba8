"""Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, ``data: [DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def event(value: Any) -> str:
    return f"data: {json.dumps(value, ensure_ascii=False)}\n\n"
