"""The MCP servers' tools on the GUI thread: which tools there are, and running one.

:class:`ToolManager` lists every configured server's tools through :class:`McpClient` (its own
asyncio thread) and keeps the result here; a call's result comes back as ``callFinished``. The
futures complete on the MCP thread and only emit signals, which Qt queues to the GUI thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.tools.client import McpClient
from app.tools.servers import McpServer


class ToolManager(QObject):
    toolsChanged = Signal()
    serverFailed = Signal(str, str)  # server name, why
    callFinished = Signal(str, str, bool)  # call id, result text, is an error
    _listed = Signal(int, str, object)  # generation, server name, tools | error text
    _called = Signal(str, str, bool)

    def __init__(self, client: McpClient | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._client = client
        self.servers: list[McpServer] = []
        self.tools: dict[str, tuple[McpServer, dict[str, Any]]] = {}  # name -> server, OpenAI schema
        self.pending_listings = 0
        self._generation = 0
        self._listed.connect(self._on_listed)
        self._called.connect(self.callFinished)

    @property
    def client(self) -> McpClient:
        if self._client is None:
            self._client = McpClient()
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def set_servers(self, servers: Sequence[McpServer]) -> None:
        """Use ``servers`` from now on and list their tools (``toolsChanged`` once each answers)."""
        self._generation += 1
        generation = self._generation
        self.servers = list(servers)
        self.tools = {}
        self.pending_listings = len(self.servers)
        if not self.servers:
            self.toolsChanged.emit()
        for server in self.servers:
            future = self.client.list_tools(server)
            future.add_done_callback(lambda f, s=server: self._listed.emit(generation, s.name, _outcome(f)))

    def _on_listed(self, generation: int, name: str, outcome: Any) -> None:
        if generation != self._generation:
            return
        self.pending_listings -= 1
        server = next(s for s in self.servers if s.name == name)
        if isinstance(outcome, str):
            self.serverFailed.emit(name, outcome)
        else:
            for schema in outcome:
                self.tools.setdefault(schema["function"]["name"], (server, schema))
        self.toolsChanged.emit()

    def openai_tools(self) -> list[dict[str, Any]]:
        return [schema for _, schema in self.tools.values()]

    def server_of(self, tool: str) -> McpServer | None:
        entry = self.tools.get(tool)
        return entry[0] if entry else None

    def call(self, call_id: str, name: str, arguments: str) -> None:
        """Run a tool; its result (or why it failed) arrives as ``callFinished(call_id, ...)``."""
        entry = self.tools.get(name)
        if entry is None:
            self._called.emit(call_id, f"There is no tool named {name!r}.", True)
            return
        try:
            args = json.loads(arguments) if arguments.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("the arguments are not a JSON object")
        except ValueError as exc:
            self._called.emit(call_id, f"The arguments could not be read: {exc}", True)
            return
        future = self.client.call_tool(entry[0], name, args)
        future.add_done_callback(lambda f: self._called.emit(call_id, *_call_outcome(f)))


def _outcome(future: Future) -> Any:
    exc = future.exception()
    return str(exc) if exc is not None else future.result()


def _call_outcome(future: Future) -> tuple[str, bool]:
    exc = future.exception()
    return (str(exc), True) if exc is not None else future.result()
