"""The MCP client side: an asyncio loop on a thread of its own, so no MCP traffic ever runs on
the GUI thread. Each operation connects with the official SDK's ``Client`` (spawning a stdio
server, or opening its streamable-HTTP session), does its work and disconnects: a server that
crashed or was restarted between two calls is simply started or reached again.

Methods return ``concurrent.futures.Future`` s; the Qt side (:mod:`app.tools.manager`) turns
their completion into queued signals.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future
from typing import Any

from app.tools.servers import McpServer

CALL_TIMEOUT_S = 120.0
LIST_TIMEOUT_S = 30.0


class McpError(RuntimeError):
    """An MCP server could not be reached or failed a request; the text says which and why."""


def _tool_schema(tool: Any) -> dict[str, Any]:
    """An MCP tool in OpenAI's form ({"type": "function", "function": {...}})."""
    parameters = tool.input_schema if hasattr(tool, "input_schema") else getattr(tool, "inputSchema", None)
    function = {
        "name": tool.name,
        "description": tool.description or "",
        "parameters": parameters or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": function}


def _result_text(result: Any) -> tuple[str, bool]:
    """A call's result as text for the model, and whether the tool reported an error."""
    parts = []
    for block in getattr(result, "content", None) or ():
        text = getattr(block, "text", None)
        if text is not None:
            parts.append(text)
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} omitted]")
    structured = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    is_error = bool(getattr(result, "is_error", False) or getattr(result, "isError", False))
    return "\n".join(parts), is_error


class McpClient:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def list_tools(self, server: McpServer) -> Future[list[dict[str, Any]]]:
        return asyncio.run_coroutine_threadsafe(self._list(server), self._loop)

    def call_tool(self, server: McpServer, name: str, arguments: dict[str, Any]) -> Future[tuple[str, bool]]:
        return asyncio.run_coroutine_threadsafe(self._call(server, name, arguments), self._loop)

    async def _list(self, server: McpServer) -> list[dict[str, Any]]:
        from mcp import Client

        try:
            async with asyncio.timeout(LIST_TIMEOUT_S), Client(server.target()) as client:
                result = await client.list_tools()
        except Exception as exc:
            raise McpError(f"the MCP server {server.name!r} could not list its tools: {_why(exc)}") from exc
        return [_tool_schema(tool) for tool in result.tools]

    async def _call(self, server: McpServer, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        from mcp import Client

        try:
            async with asyncio.timeout(CALL_TIMEOUT_S), Client(server.target()) as client:
                result = await client.call_tool(name, arguments)
        except Exception as exc:
            raise McpError(f"the tool {name!r} of {server.name!r} failed: {_why(exc)}") from exc
        return _result_text(result)


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _why(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}"
