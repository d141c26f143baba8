"""OpenAI chat messages -> the messages a chat template renders, and the images they carry.

Text parts are joined into one string (every template takes a string; not all take parts).
A message with images keeps parts, ``{"type": "image"}`` where each image was, as the vision
prompt builder expects (``engine.vision.prompt``), and the images come back in prompt order.
Earlier tool calls keep OpenAI's shape with their arguments parsed into objects, as transformers'
templates expect them; a ``tool`` message gets the called function's ``name`` too, which some
templates print.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.serve.errors import bad_request
from engine.serve.media import read_image

ROLES = {"system", "developer", "user", "assistant", "tool"}


def convert_messages(
    messages: Sequence[dict[str, Any]], allowed_dirs: Sequence[Path]
) -> tuple[list[dict[str, Any]], list[bytes]]:
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    names: dict[str, str] = {}  # tool call id -> function name
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", param=f"{where}.role"
            )
        content, found = _content(message.get("content"), where, allowed_dirs)
        images += found
        converted: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            converted["tool_calls"] = _tool_calls(message["tool_calls"], where, names)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(
                    f"{where}.tool_call_id is required for a tool message", param=f"{where}.tool_call_id"
                )
            converted["tool_call_id"] = call_id
            name = message.get("name") or names.get(call_id)
            if name:
                converted["name"] = name
        if content is None and "tool_calls" not in converted:
            raise bad_request(f"{where}.content is required", param=f"{where}.content")
        out.append(converted)
    return out, images


def _content(content: Any, where: str, allowed_dirs: Sequence[Path]) -> tuple[Any, list[bytes]]:
    if content is None or isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    images: list[bytes] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise bad_request(f"{at}.image_url.url must be a string", param=f"{at}.image_url")
            images.append(read_image(url, allowed_dirs, f"{at}.image_url"))
            parts.append({"type": "image"})
        else:
            raise bad_request(f"{at}: unsupported content part type {kind!r}", param=at)
    if not images:
        return "\n".join(p["text"] for p in parts), []
    return parts, images


def _tool_calls(calls: Any, where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at}.function.name is required", param=f"{at}.function")
        raw = function.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise bad_request(
                f"{at}.function.arguments is not valid JSON", param=f"{at}.function.arguments"
            ) from None
        call_id = call.get("id") or f"call_{j}"
        names[call_id] = function["name"]
        out.append(
            {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": args}}
        )
    return out
