"""One round of tool use: the calls a reply made, each asked about, run and recorded.

When a reply ends with tool calls, the chat controller hands them to :meth:`ToolLoop.begin`. Each
call in turn is either run at once (its tool is in the "always allowed" list) or offered to the
user (``approvalRequested``), who allows it once, always, or denies it. An allowed call runs on
the MCP client's thread (:class:`app.tools.manager.ToolManager`); a denied one gets a refusal as
its result, which the model is told. Every change is written to the store with the message
(``Store.set_tool_calls``) and announced (``callsChanged``), so the chat shows it and a restart
keeps it. Once no call is left, ``roundFinished`` lets the controller send the results back to
the model. GUI thread only.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.store import Store
from app.tools.approval import ALLOW_ALWAYS, DENY

log = logging.getLogger(__name__)

DENIED_RESULT = "The user denied this tool call; it was not run."
NOT_RUN_RESULT = "This tool call was not run (the reply was stopped)."


def openai_calls(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored calls in OpenAI's message form."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]


def result_messages(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``tool`` message per call: its result, a refusal, or that it never ran."""
    out = []
    for c in calls:
        if c.get("status") in ("done", "error", "denied"):
            content = c.get("result", "")
        else:
            content = NOT_RUN_RESULT
        out.append({"role": "tool", "tool_call_id": c["id"], "content": content})
    return out


class ToolLoop(QObject):
    approvalRequested = Signal(object)  # the call: {"id", "name", "arguments", ...}
    callsChanged = Signal(int, object)  # message id, its calls
    roundFinished = Signal(int, int)  # conversation id, message id whose calls are all resolved
    runningChanged = Signal(bool)

    def __init__(
        self,
        store: Store,
        always_allowed: Callable[[], list[str]] = list,
        allow_always: Callable[[str], None] = lambda name: None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.store = store
        self.manager: Any = None  # app.tools.manager.ToolManager, set once the window has one
        self.always_allowed = always_allowed
        self.allow_always = allow_always
        self.conversation_id = 0
        self.message_id = 0
        self.calls: list[dict[str, Any]] = []

    @property
    def running(self) -> bool:
        return bool(self.calls)

    def set_manager(self, manager: Any) -> None:
        self.manager = manager
        manager.callFinished.connect(self._on_call_finished)

    def begin(self, conversation_id: int, message_id: int, calls: Sequence[dict[str, Any]]) -> None:
        """Resolve the tool calls (OpenAI's form) a reply just made."""
        self.conversation_id, self.message_id = conversation_id, message_id
        self.calls = [
            {
                "id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"].get("arguments") or "{}",
                "status": "pending",
                "result": "",
            }
            for c in calls
        ]
        self._save()
        self.runningChanged.emit(True)
        self._next()

    def decide(self, call_id: str, answer: str) -> None:
        call = self._find(call_id)
        if call is None or call["status"] != "pending":
            return
        if answer == DENY:
            call.update(status="denied", result=DENIED_RESULT)
            self._save()
            self._next()
            return
        if answer == ALLOW_ALWAYS:
            self.allow_always(call["name"])
        self._run(call)

    def cancel(self) -> None:
        """Stop the round: calls not yet resolved stay unrun (and say so to the model later)."""
        if not self.calls:
            return
        for call in self.calls:
            if call["status"] in ("pending", "running"):
                call.update(status="cancelled", result=NOT_RUN_RESULT)
        self._save()
        self._end()

    # -- internals ---------------------------------------------------------------------------------

    def _find(self, call_id: str) -> dict[str, Any] | None:
        return next((c for c in self.calls if c["id"] == call_id), None)

    def _next(self) -> None:
        if any(c["status"] == "running" for c in self.calls):
            return
        call = next((c for c in self.calls if c["status"] == "pending"), None)
        if call is None:
            conversation_id, message_id = self.conversation_id, self.message_id
            self._end()
            self.roundFinished.emit(conversation_id, message_id)
        elif call["name"] in self.always_allowed():
            self._run(call)
        else:
            self.approvalRequested.emit(dict(call))

    def _run(self, call: dict[str, Any]) -> None:
        if self.manager is None:
            call.update(status="error", result="No MCP server is set up (Settings › Tools).")
            self._save()
            self._next()
            return
        call["status"] = "running"
        self._save()
        self.manager.call(call["id"], call["name"], call["arguments"])

    def _on_call_finished(self, call_id: str, text: str, is_error: bool) -> None:
        call = self._find(call_id)
        if call is None or call["status"] != "running":
            return  # a round that was stopped meanwhile
        call.update(status="error" if is_error else "done", result=text)
        self._save()
        self._next()

    def _save(self) -> None:
        try:
            self.store.set_tool_calls(self.message_id, self.calls)
        except sqlite3.Error as exc:  # shown anyway; the next save tries again
            log.warning("could not save tool calls: %s", exc)
        self.callsChanged.emit(self.message_id, [dict(c) for c in self.calls])

    def _end(self) -> None:
        self.calls = []
        self.runningChanged.emit(False)
