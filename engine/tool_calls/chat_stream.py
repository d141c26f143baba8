"""Tool use in a chat session's stream: the prompt with the tools, and the calls read back.

:class:`ToolChat` is made once per reply that offers tools or has tool calls in its history. Its
``messages`` turns the conversation into what the model's template takes
(:func:`engine.tool_calls.prompt.tool_prompt`), and its ``read`` moves the calls out of each
streamed chunk's text into the chunk's ``tool_calls`` (the answer text stays), with the format's
special-token markers written back first, as the server's reply reader does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from engine.api import StreamChunk
from engine.tool_calls import detect_format, make_parser
from engine.tool_calls.prompt import tool_prompt


def has_tool_history(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _arguments_as_objects(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Templates write earlier calls' arguments with ``tojson``: they want objects, not the JSON
    text OpenAI's messages carry."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", {}))
                args = function.get("arguments")
                if isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        function["arguments"] = {}
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


class ToolChat:
    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools]
        probe = tool_prompt([], self.tools, detect_format(tokenizer), tokenizer.chat_template)
        self.format = probe.format
        self.template_args = probe.template_args
        self._parser = make_parser(self.format)
        self._markers: dict[int, str] = {}
        for marker in self._parser.markers:
            token = tokenizer.token_to_id(marker)
            if token is not None and tokenizer.decode([token]) == "":
                self._markers[token] = marker

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template takes it (tools in the system prompt where the
        template knows none, earlier calls and results in the format the model reads)."""
        prompt = tool_prompt(
            _arguments_as_objects(messages), self.tools, self.format, self.tokenizer.chat_template
        )
        return prompt.messages

    def read(self, chunk: StreamChunk) -> StreamChunk:
        """The chunk with its calls moved out of the text into ``tool_calls`` (only while tools
        are offered: a history with calls but no tools now offered reads plain text)."""
        if not self.tools:
            return chunk
        marked = chunk.text + "".join(self._markers.get(t, "") for t in chunk.token_ids)
        delta = self._parser.feed(marked)
        if chunk.done:
            delta = delta + self._parser.finish()
        calls = tuple(call.to_openai() for call in delta.calls)
        return replace(
            chunk, text=delta.content, reasoning=chunk.reasoning + delta.reasoning, tool_calls=calls
        )
