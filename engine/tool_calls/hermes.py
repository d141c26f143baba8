"""Qwen / Hermes tool calls: JSON objects in ``<tool_call>`` tags, one tag per call::

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Used by Qwen 2.5 / 3, Hermes 2 Pro / 3, and here by any model whose chat template knows no tools
(its prompt then describes this format: :attr:`HermesParser.instructions`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from engine.tool_calls.base import ToolCall, ToolCallParser, call_from_object, decode_json_values

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A block closed by its tag, or left open at the end of the reply (a model that stopped there).
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesParser(ToolCallParser):
    name = "hermes"
    start = OPEN
    markers = (OPEN, CLOSE)
    instructions = (
        "You can call functions to help with the user's request. The functions, one JSON object "
        "per line:\n<tools>\n{tools}\n</tools>\n\nTo call one, reply with a JSON object holding "
        "its name and arguments inside <tool_call></tool_call> tags, one tag per call:\n"
        '<tool_call>\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
    )

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        calls: list[ToolCall] = []
        rest: list[str] = []
        last = 0
        for block in _BLOCK.finditer(text):
            rest.append(text[last : block.start()])
            last = block.end()
            values = decode_json_values(block.group(1))
            found = [call_from_object(v) for v in values] if values else []
            if found and all(found):
                calls.extend(found)
            else:
                rest.append(block.group(0))  # not a call this format knows: keep it as text
        rest.append(text[last:])
        return calls, "".join(rest).strip()

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return f"{OPEN}\n{super().format_call(name, arguments)}\n{CLOSE}"
