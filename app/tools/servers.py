"""An MCP server as the user adds it: a command to start (stdio) or a URL (streamable HTTP).

Kept in the settings as one JSON object each (``tools.mcp_servers``); :func:`parse_server`
checks one, :meth:`McpServer.target` is what the ``mcp`` SDK's ``Client`` connects to.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class McpServer:
    name: str
    command: str = ""  # a command line, started with its stdin/stdout as the transport
    url: str = ""  # a streamable-HTTP endpoint (http://host/mcp)

    def target(self) -> Any:
        from mcp import StdioServerParameters  # lazy: the SDK is only needed once tools are used

        if self.url:
            return self.url
        argv = shlex.split(self.command)
        return StdioServerParameters(command=argv[0], args=argv[1:])

    def to_setting(self) -> str:
        value = (
            {"name": self.name, "url": self.url} if self.url else {"name": self.name, "command": self.command}
        )
        return json.dumps(value)

    @property
    def describe(self) -> str:
        return self.url or self.command


def make_server(name: str, command_or_url: str) -> McpServer:
    """A server from what the user typed: a URL (http/https) or a command line; ValueError says
    what is wrong."""
    name, text = name.strip(), command_or_url.strip()
    if not name:
        raise ValueError("give the server a name")
    if not text:
        raise ValueError("give a command to start the server, or its http:// URL")
    if text.startswith(("http://", "https://")):
        if not urlsplit(text).netloc:
            raise ValueError(f"{text!r} has no host")
        return McpServer(name, url=text)
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"the command cannot be read: {exc}") from None
    if not argv:
        raise ValueError("the command is empty")
    return McpServer(name, command=text)


def parse_server(text: str) -> McpServer:
    value = json.loads(text)
    return make_server(str(value.get("name", "")), str(value.get("url") or value.get("command") or ""))


def servers_from_setting(values: list[str]) -> list[McpServer]:
    out = []
    for text in values:
        try:
            out.append(parse_server(text))
        except (ValueError, AttributeError):
            continue  # a damaged entry: leave it out rather than fail every tool
    return out
