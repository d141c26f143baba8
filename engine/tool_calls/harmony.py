"""gpt-oss tool calls, in its "harmony" reply format (see :mod:`engine.reasoning.harmony`).

A reply is a run of messages, each a header and a body. A call is a message whose header names
a recipient, ``to=functions.NAME``, with the arguments as its body, ended by ``<|call|>``::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may also stand before ``<|channel|>``). Messages on the ``final`` channel are the
answer (content); the others without a recipient are reasoning, as the reasoning splitter
classes them. The markers are special tokens: the caller writes them into the text.
"""

from __future__ import annotations

import json
import re

from engine.tool_calls.base import ParsedDelta, ToolCall, ToolCallParser, held_prefix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
ALL = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER, _BODY, _BETWEEN = "header", "body", "between"


class HarmonyParser(ToolCallParser):
    name = "harmony"
    markers = ALL

    def __init__(self) -> None:
        super().__init__()
        self._state = _HEADER  # the prompt ends where the first message's header begins
        self._header = ""
        self._kind = "content"  # the body's: "content", "reasoning" or "call"
        self._recipient = ""
        self._args = ""
        self._buffer = ""
        self._any_marker = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            found = [(self._buffer.find(m), m) for m in ALL]
            found = [(at, m) for at, m in found if at >= 0]
            if not found:
                break
            at, marker = min(found)
            out += self._text(self._buffer[:at])
            self._buffer = self._buffer[at + len(marker) :]
            out += self._marker(marker)
        keep = max(held_prefix(self._buffer, m) for m in ALL)
        cut = len(self._buffer) - keep
        out += self._text(self._buffer[:cut])
        self._buffer = self._buffer[cut:]
        return out

    def finish(self) -> ParsedDelta:
        out = self._text(self._buffer)
        self._buffer = ""
        if not self._any_marker:  # no harmony at all: the text was all answer
            out += ParsedDelta(content=self._header)
        elif self._state == _BODY and self._kind == "call":
            out += self._end_call()  # the model stopped without <|call|>: the call is still whole
        return out

    def _text(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self._state == _HEADER:
            self._header += text
        elif self._state == _BODY:
            if self._kind == "call":
                self._args += text
            elif self._kind == "content":
                return ParsedDelta(content=text)
            else:
                return ParsedDelta(reasoning=text)
        return ParsedDelta()  # text between messages is structure

    def _marker(self, marker: str) -> ParsedDelta:
        self._any_marker = True
        if marker == START:
            self._state, self._header = _HEADER, ""
        elif marker in (CHANNEL, CONSTRAIN) and self._state == _HEADER:
            self._header += marker
        elif marker == MESSAGE and self._state == _HEADER:
            self._open_body()
        elif marker in ENDS and self._state == _BODY:
            out = self._end_call() if self._kind == "call" else ParsedDelta()
            self._state = _BETWEEN
            return out
        return ParsedDelta()

    def _open_body(self) -> None:
        header = self._header
        recipient = _RECIPIENT.search(header)
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        channel = channel.split(CONSTRAIN, 1)[0].split()
        if recipient is not None:
            self._kind, self._recipient, self._args = "call", recipient.group(1), ""
        elif CHANNEL not in header or (channel and channel[0] == "final"):
            self._kind = "content"
        else:
            self._kind = "reasoning"
        self._state = _BODY

    def _end_call(self) -> ParsedDelta:
        name = self._recipient.removeprefix("functions.")
        args = self._args.strip()
        try:
            args = json.dumps(json.loads(args), ensure_ascii=False) if args else "{}"
        except ValueError:
            pass  # not JSON: handed on as the model wrote it
        self._args = ""
        return ParsedDelta(calls=[ToolCall(name, args)])
