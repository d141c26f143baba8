"""A small MCP server for the tool-use tests (the official ``mcp`` SDK, stdio): two tools.

Run as ``python mcp_test_server.py [LOG]``; every call is appended to the file LOG (when given),
so a test can tell whether a tool ran.
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("trellis-test-tools")


def _log(line: str) -> None:
    if len(sys.argv) > 1:
        with open(sys.argv[1], "a", encoding="utf-8") as f:
            f.write(line + "\n")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    _log(f"add {a} {b}")
    return a + b


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    _log(f"shout {text}")
    return text.upper()


if __name__ == "__main__":
    server.run()
