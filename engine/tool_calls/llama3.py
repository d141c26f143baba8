"""Llama 3.1 - 3.3 tool calls: a JSON object with the name and ``parameters``, either as the whole
reply or after the ``<|python_tag|>`` special token::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls are separated by ``;``. A reply that opens with ``{`` but is not such an object
(an answer in JSON) is given back as content when it ends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.tool_calls.base import ToolCall, ToolCallParser, call_from_object, decode_json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3"
    start = PYTHON_TAG
    bare_starts = ("{",)
    markers = (PYTHON_TAG,)
    instructions = (
        "You can call functions to help with the user's request. The functions, one JSON object "
        "per line:\n{tools}\n\nTo call one, reply with nothing but a JSON object of the form "
        '{{"name": "function name", "parameters": {{"argument": "value"}}}}.'
    )

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        body = text.removeprefix(PYTHON_TAG)
        values = decode_json_values(body)
        if not values:
            return [], text
        calls = [call_from_object(v) for v in values]
        # A JSON answer that merely has a "name" is not a call: Llama's calls carry parameters.
        if not all(calls) or not all(
            isinstance(v, dict) and ("parameters" in v or "arguments" in v) for v in values
        ):
            return [], text
        return calls, ""

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": dict(arguments)}, ensure_ascii=False)
