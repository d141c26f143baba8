"""Mistral tool calls, after the ``[TOOL_CALLS]`` control token. Two generations of the format:

* a JSON list (v3 tokenizers: Mistral 7B v0.3, Mixtral 8x22B, Nemo)::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

* name, then ``[ARGS]`` and the arguments, the marker repeated per call (v11+ tokenizers:
  Mistral Small 3.2, Magistral, Devstral), optionally with ``[CALL_ID]``::

      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
"""

from __future__ import annotations

import json

from engine.tool_calls.base import ToolCall, ToolCallParser, call_from_object, decode_json_values

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser(ToolCallParser):
    name = "mistral"
    start = TOOL_CALLS
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        segments = [s for s in text.split(TOOL_CALLS) if s.strip()]
        if segments and segments[0].lstrip().startswith("["):
            return self._json_list(segments[0])
        calls = [self._named(s) for s in segments]
        if not calls or not all(calls):
            return [], text
        return calls, ""

    @staticmethod
    def _json_list(body: str) -> tuple[list[ToolCall], str]:
        values = decode_json_values(body)
        if not values or not isinstance(values[0], list):
            return [], body
        items = [item for value in values for item in (value if isinstance(value, list) else [value])]
        calls = [call_from_object(item) for item in items]
        return (calls, "") if calls and all(calls) else ([], body)

    @staticmethod
    def _named(segment: str) -> ToolCall | None:
        head, sep, args = segment.partition(ARGS)
        if not sep:
            return None
        name, _, call_id = head.partition(CALL_ID)
        values = decode_json_values(args)
        if not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        call = {"name": name.strip(), "arguments": values[0]}
        if call_id.strip():
            call["id"] = call_id.strip()
        return call_from_object(call)

    def format_call(self, name: str, arguments) -> str:
        return f"{TOOL_CALLS}{name}{ARGS}{json.dumps(dict(arguments), ensure_ascii=False)}"
