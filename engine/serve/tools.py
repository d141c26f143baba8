"""A request's ``tools``, ``tool_choice`` and ``response_format``: checked, and turned into what
the reply needs: the tool-call format to read, a function the output is forced to call, and the
JSON schema that constrains the output (the engine's constrained-output path)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.serve.errors import bad_request


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # as offered (empty: none, or tool_choice "none")
    read_calls: bool  # parse the reply for calls in the model's format
    forced: str | None = None  # output is this function's arguments ("*": any function's call)
    schema: dict[str, Any] | None = None  # the output's JSON schema (forced call or response_format)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def check_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}].function.name is required", param=f"tools[{i}].function.name")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]"
            )
        out.append({"type": "function", "function": function})
    return out


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format.json_schema.schema is required", param="response_format")
        return schema if isinstance(schema, dict) else {}
    raise bad_request(f"unsupported response_format type {kind!r}", param="response_format")


def plan_tools(tools: Any, tool_choice: Any, response_format: dict[str, Any] | None) -> ToolPlan:
    offered = check_tools(tools)
    schema = response_schema(response_format)
    if tool_choice is not None and not offered:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    choice = tool_choice if tool_choice is not None else ("auto" if offered else "none")
    if choice == "none":
        return ToolPlan([], False, schema=schema)
    if choice == "auto":
        return ToolPlan(offered, True, schema=schema)
    if schema is not None:
        raise bad_request("a forced tool call cannot also have a response_format", param="response_format")
    if choice == "required":
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
            }
            for t in offered
        ]
        return ToolPlan(offered, False, "*", branches[0] if len(branches) == 1 else {"anyOf": branches})
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    chosen = [t for t in offered if t["function"]["name"] == name]
    if not chosen:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolPlan(offered, False, name, _parameters(chosen[0]))
