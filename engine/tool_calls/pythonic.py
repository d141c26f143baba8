"""Python-style tool calls: the whole reply is a list of calls with keyword arguments::

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

The format Google's guide prompts Gemma 2 / 3 with (their templates know no tools), also used by
Llama 3.2 / 4's "pythonic" mode. Read with :mod:`ast` and ``literal_eval``: the text is parsed,
never run. A reply may wrap the list in a ```` ```tool_code ```` fence, as older Gemma guides
ask.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from engine.tool_calls.base import ToolCall, ToolCallParser

_FENCE = re.compile(r"^\s*```(?:tool_code|python|py)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class PythonicParser(ToolCallParser):
    name = "pythonic"
    bare_starts = ("[", "```tool_code", "```python")
    instructions = (
        "You have access to functions. To call any of them, reply with nothing but a list of "
        "calls in the format [func_name1(param1=value1, param2=value2), func_name2(param=value)]. "
        "The functions, one JSON object per line:\n{tools}"
    )

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        fenced = _FENCE.match(text)
        source = (fenced.group(1) if fenced else text).strip()
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return [], text
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or node.args:
                return [], text
            name = _name(node.func)
            if name is None or any(k.arg is None for k in node.keywords):
                return [], text
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return [], text
        return calls, ""

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in dict(arguments).items())
        return f"[{name}({args})]"
