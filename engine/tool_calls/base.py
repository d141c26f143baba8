"""What every tool-call format shares: the call, a parser's output, and the streaming skeleton.

A parser is fed a reply as it streams, one piece of text at a time, and says which of the new
text is plain answer (``content``), which is reasoning, and which tool calls are complete
(:class:`ParsedDelta`). It never takes text back: text that might still turn out to start a tool
call (half of ``<tool_call>``) is held until it is known either way, and a tool call is handed
out whole, once its arguments are complete.

Markers that are special tokens (``[TOOL_CALLS]``, ``<|python_tag|>``, harmony's ``<|call|>``)
decode to nothing in the generator's text; the caller writes them into the text fed here
(:attr:`ToolCallParser.markers` lists the ones a format needs), after the text of the step that
produced them, as :mod:`engine.reasoning.harmony` reads them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    """An id for a tool call the model did not name itself (OpenAI's look: ``call_`` + 24 chars)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is the JSON text of an object, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as an item of an OpenAI message's ``tool_calls`` (``index``: in a stream)."""
        item: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            item = {"index": index, **item}
        return item


@dataclass
class ParsedDelta:
    """What a piece of a reply added, by kind."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(
            self.content + other.content, self.reasoning + other.reasoning, self.calls + other.calls
        )

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


def call_from_object(value: Any) -> ToolCall | None:
    """A call from a parsed ``{"name": ..., "arguments" | "parameters": {...}}`` (the arguments
    as an object, or as JSON text of one); None when ``value`` is not such a thing."""
    if not isinstance(value, Mapping):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text, as OpenAI sends them
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        return None
    call_id = value.get("id")
    arguments = json.dumps(args, ensure_ascii=False)
    if isinstance(call_id, str) and call_id:
        return ToolCall(name.strip(), arguments, call_id)
    return ToolCall(name.strip(), arguments)


def decode_json_values(text: str) -> list[Any] | None:
    """The JSON values written one after another in ``text`` (separated by whitespace, commas or
    semicolons, as models list several calls); None unless all of it is such values."""
    decoder = json.JSONDecoder()
    values, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (to be held
    back until the next piece shows whether the marker really comes)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallParser:
    """Base of the formats whose calls follow the answer's text, opened by a marker
    (:attr:`start`) or by a reply that starts with one of :attr:`bare_starts`.

    Text before the opening streams as content. From the opening on, the rest of the reply is
    held and read at :meth:`finish` (:meth:`parse_calls`): calls the format cannot read are given
    back as content, so no text is ever lost."""

    name: ClassVar[str] = ""
    start: ClassVar[str | None] = None  # the marker that opens the calls
    bare_starts: ClassVar[tuple[str, ...]] = ()  # a reply starting with one of these is all calls
    # Texts of markers this format needs to see, special tokens or not (see the module doc).
    markers: ClassVar[tuple[str, ...]] = ()
    # Markers that end a reply as the model's stop tokens do (FunctionGemma's response opener).
    stop_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._pending = ""  # content not yet known to be content
        self._calls: str | None = None  # the held tool-call text, once the calls have opened
        self._started = False  # some non-blank text has come

    def feed(self, text: str) -> ParsedDelta:
        if self._calls is not None:
            self._calls += text
            return ParsedDelta()
        self._pending += text
        if not self._started:
            stripped = self._pending.lstrip()
            if not stripped or any(b.startswith(stripped) and b != stripped for b in self.bare_starts):
                return ParsedDelta()  # blanks, or half an opening: the reply may still be a call
            self._started = True
            if stripped.startswith(self.bare_starts):
                self._calls, self._pending = stripped, ""
                return ParsedDelta()
        if self.start is None:
            out, self._pending = self._pending, ""
            return ParsedDelta(content=out)
        at = self._pending.find(self.start)
        if at >= 0:
            content, self._calls, self._pending = self._pending[:at], self._pending[at:], ""
            return ParsedDelta(content=content)
        keep = held_prefix(self._pending, self.start)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return ParsedDelta(content=out)

    def finish(self) -> ParsedDelta:
        if self._calls is None:
            out, self._pending = self._pending, ""
            return ParsedDelta(content=out)
        text, self._calls = self._calls, None
        calls, leftover = self.parse_calls(text)
        if not calls:
            return ParsedDelta(content=text)  # not a call after all: the model's text as it was
        return ParsedDelta(content=leftover, calls=calls)

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        """The calls in ``text`` (which starts at the opening) and the text around them that is
        not part of any call; no calls: the caller keeps ``text`` as content."""
        raise NotImplementedError

    # -- prompting a model whose chat template ignores ``tools`` -------------------------------

    instructions: ClassVar[str | None] = None  # format(tools=JSON lines) for such a model

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """An earlier call of the conversation written back as this format's reply text."""
        return json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
