"""Tools and earlier tool calls in the prompt.

A chat template that knows tools (it reads the ``tools`` variable, as Qwen's, Llama 3.1's,
Mistral's, gpt-oss's and FunctionGemma's do) gets them as transformers passes them: ``tools=``
the OpenAI-style list, and the conversation's earlier calls as the messages' ``tool_calls`` with
their arguments as objects (templates write them with ``tojson``).

A template that knows none (SmolLM2's, Gemma 3's) would silently drop them, so the tools are
described in the system message instead, in a format the engine can read back (the format's
``instructions``: pythonic for Gemma, else Hermes), earlier calls are written into the
assistant's text in that format, and tool results become user turns (templates like Gemma's
refuse any role but user and assistant).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tool_calls import PARSERS

RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class ToolPrompt:
    messages: list[dict[str, Any]]  # for the chat template
    template_args: dict[str, Any] = field(default_factory=dict)  # e.g. {"tools": [...]}
    format: str = "hermes"  # the format the reply is read in


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tool_prompt(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    fmt: str,
    template: str | None,
) -> ToolPrompt:
    """The template's messages and variables for a conversation with ``tools`` (OpenAI's
    ``[{"type": "function", "function": {...}}]``; None or empty: none offered), in format
    ``fmt`` (see :func:`engine.tool_calls.detect_format`). ``messages`` may hold assistant turns
    with ``tool_calls`` (arguments as objects) and ``tool`` turns."""
    if template_knows_tools(template):
        args = {"tools": [dict(t) for t in tools]} if tools else {}
        return ToolPrompt([dict(m) for m in messages], args, fmt)
    if PARSERS[fmt].instructions is None:
        fmt = "hermes"  # the format has no prompt of its own: describe Hermes', read Hermes'
    parser = PARSERS[fmt]()
    out = _inline_history(messages, parser)
    if tools:
        lines = "\n".join(json.dumps(dict(t.get("function", t)), ensure_ascii=False) for t in tools)
        text = parser.instructions.format(tools=lines)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return ToolPrompt(out, {}, fmt)


def _text(content: Any) -> str:
    return content if isinstance(content, str) else ""


def _inline_history(messages: Sequence[Mapping[str, Any]], parser) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            written = [
                parser.format_call(c["function"]["name"], c["function"].get("arguments") or {})
                for c in message["tool_calls"]
            ]
            text = "\n".join([_text(message.get("content")), *written]).strip()
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            result = f"{RESULT_OPEN}\n{_text(message.get('content'))}\n{RESULT_CLOSE}"
            if out and out[-1]["role"] == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result  # results of one turn's calls: one user turn
            else:
                out.append({"role": "user", "content": result, "_results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]
