"""Gemma tool calls.

Gemma 3 has no tool tokens. Two documented formats exist, and both are read here:

* **FunctionGemma** (Gemma 3 270M tuned for function calling) wraps each call in control tokens,
  its arguments in a notation of its own where every string sits between ``<escape>`` tokens
  (so braces and commas inside a string are text, not structure)::

      <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>

  Values: ``<escape>``-delimited strings, numbers, ``true``/``false``/``null``, ``{...}``
  objects and ``[...]`` lists. The model follows a call with ``<start_function_response>``,
  which ends its turn (:attr:`FunctionGemmaParser.stop_markers`).
* **Gemma 2 / 3 instruction models** are prompted to answer with a Python-style list of calls
  (Google's "function calling with Gemma" guide): :mod:`engine.tool_calls.pythonic`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from engine.tool_calls.base import ToolCall, ToolCallParser

START, END, ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
RESPONSE = "<start_function_response>"
_NAME = re.compile(r"\s*call:([^{\s]+)\s*")
_SCALAR_END = re.compile(r"[,}\]]")


class _Syntax(ValueError):
    pass


class _Reader:
    """A recursive-descent reader of FunctionGemma's argument notation."""

    def __init__(self, text: str, at: int) -> None:
        self.text, self.at = text, at

    def skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def expect(self, char: str) -> None:
        self.skip()
        if not self.text.startswith(char, self.at):
            raise _Syntax(f"expected {char!r} at {self.at}")
        self.at += len(char)

    def value(self) -> Any:
        self.skip()
        if self.text.startswith(ESCAPE, self.at):
            end = self.text.find(ESCAPE, self.at + len(ESCAPE))
            if end < 0:
                raise _Syntax("unterminated string")
            out = self.text[self.at + len(ESCAPE) : end]
            self.at = end + len(ESCAPE)
            return out
        if self.text.startswith("{", self.at):
            return self.mapping()
        if self.text.startswith("[", self.at):
            return self.sequence()
        found = _SCALAR_END.search(self.text, self.at)
        if found is None:
            raise _Syntax("unterminated value")
        word = self.text[self.at : found.start()].strip()
        self.at = found.start()
        return _scalar(word)

    def mapping(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.skip()
        if self.text.startswith("}", self.at):
            self.at += 1
            return out
        while True:
            self.skip()
            colon = self.text.find(":", self.at)
            if colon < 0:
                raise _Syntax("a key without a value")
            key = self.text[self.at : colon].strip()
            if key.startswith(ESCAPE) and key.endswith(ESCAPE) and len(key) >= 2 * len(ESCAPE):
                key = key[len(ESCAPE) : -len(ESCAPE)]
            self.at = colon + 1
            out[key] = self.value()
            self.skip()
            if self.text.startswith(",", self.at):
                self.at += 1
                continue
            self.expect("}")
            return out

    def sequence(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        self.skip()
        if self.text.startswith("]", self.at):
            self.at += 1
            return out
        while True:
            out.append(self.value())
            self.skip()
            if self.text.startswith(",", self.at):
                self.at += 1
                continue
            self.expect("]")
            return out


def _scalar(word: str) -> Any:
    if word in ("true", "false", "null"):
        return json.loads(word)
    try:
        return json.loads(word)  # numbers
    except ValueError:
        return word  # an unquoted word: the model meant a string


def _format_value(value: Any) -> str:
    if isinstance(value, str):
        return f"{ESCAPE}{value}{ESCAPE}"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    return json.dumps(value)


class FunctionGemmaParser(ToolCallParser):
    name = "functiongemma"
    start = START
    markers = (START, END, ESCAPE)
    stop_markers = (RESPONSE,)

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        calls: list[ToolCall] = []
        rest: list[str] = []
        at = 0
        while True:
            begin = text.find(START, at)
            if begin < 0:
                rest.append(text[at:])
                break
            rest.append(text[at:begin])
            call, end = self._call(text, begin + len(START))
            if call is None:
                rest.append(text[begin:])  # unreadable: kept as text
                break
            calls.append(call)
            at = end
        return calls, "".join(rest).replace(RESPONSE, "").strip()

    @staticmethod
    def _call(text: str, at: int) -> tuple[ToolCall | None, int]:
        name = _NAME.match(text, at)
        if name is None:
            return None, at
        reader = _Reader(text, name.end())
        try:
            args = reader.mapping()
        except _Syntax:
            return None, at
        reader.skip()
        end = reader.at + len(END) if text.startswith(END, reader.at) else reader.at
        return ToolCall(name.group(1), json.dumps(args, ensure_ascii=False)), end

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return f"{START}call:{name}{_format_value(dict(arguments))}{END}"
