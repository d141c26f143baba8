"""The OpenAI chat-completions request a remote endpoint gets, and the stream it answers with.

:func:`request_body` turns the app's messages (images as bytes) and a ``GenerationRequest`` into
the JSON body; :func:`sse_events` reads a ``text/event-stream`` body into its ``data`` payloads.
Sampling values go by OpenAI's names; the ones OpenAI itself lacks (``top_k``, ``min_p``,
``repetition_penalty``: vLLM, llama.cpp and SGLang read them) only when set to something other
than "off", so strict servers are not sent parameters that change nothing.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from engine.api import ChatMessage, GenerationRequest

# Sampling settings (engine.generation.sampling field names) OpenAI's API has under the same name.
_STANDARD = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
# Extensions, with the value that means "off".
_EXTENDED = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _mime(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data[:3] == b"GIF":
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "image/jpeg"


def _content(message: ChatMessage) -> Any:
    images = message.get("images") or ()
    content = message.get("content", "")
    if not images:
        return content
    parts: list[dict[str, Any]] = []
    if isinstance(content, str):
        if content:
            parts.append({"type": "text", "text": content})
    else:
        parts.extend(p for p in content if p.get("type") == "text")
    for data in images:
        url = f"data:{_mime(data)};base64,{base64.b64encode(data).decode('ascii')}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def wire_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message["role"], "content": _content(message)}
        if message.get("tool_calls"):
            item["tool_calls"] = [dict(c) for c in message["tool_calls"]]
        if message.get("tool_call_id"):
            item["tool_call_id"] = message["tool_call_id"]
        out.append(item)
    return out


def request_body(model: str, messages: Sequence[ChatMessage], request: GenerationRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": wire_messages(messages),
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_new_tokens,
    }
    sampling = dict(request.sampling)
    for name in _STANDARD:
        if sampling.get(name) is not None:
            body[name] = sampling[name]
    for name, off in _EXTENDED.items():
        if sampling.get(name) is not None and sampling[name] != off:
            body[name] = sampling[name]
    if request.stop_strings:
        body["stop"] = list(request.stop_strings)
    if request.json_schema.strip():
        schema = json.loads(request.json_schema)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    if request.tools:
        body["tools"] = [dict(t) for t in request.tools]
    return body


def sse_events(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # a comment (keep-alive)
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


class ToolCallAssembler:
    """Streamed tool calls arrive in pieces by index (id and name first, then argument text);
    this puts each back together."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, deltas: Sequence[dict[str, Any]]) -> None:
        for delta in deltas:
            index = int(delta.get("index", len(self._calls)))
            call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            if delta.get("id"):
                call["id"] = delta["id"]
            function = delta.get("function") or {}
            if function.get("name"):
                call["name"] += function["name"]
            if function.get("arguments"):
                call["arguments"] += function["arguments"]

    def calls(self) -> tuple[dict[str, Any], ...]:
        out = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if not call["name"]:
                continue
            call_id = call["id"] or f"call_{index}"
            function = {"name": call["name"], "arguments": call["arguments"] or "{}"}
            out.append({"id": call_id, "type": "function", "function": function})
        return tuple(out)
