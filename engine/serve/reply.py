"""One reply as OpenAI sees it: the job's results read into content, reasoning and tool calls.

Three readers, chosen per request:

* plain: the generator's text is the content (a model with a reasoning format, gpt-oss, has it
  split off into ``reasoning_content`` by :mod:`engine.reasoning`);
* tool calls (``tools`` offered, ``tool_choice`` auto): the text, with the format's marker tokens
  written back into it, goes through the model's tool-call parser (:mod:`engine.tool_calls`);
* a forced call (``tool_choice`` "required" or a named function): the output was constrained
  to JSON of the call's arguments (or of ``{"name", "arguments"}``), and is read as the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.generation.job import JobResult
from engine.reasoning import reply_splitter
from engine.tool_calls import ParsedDelta, ToolCall, call_from_object, make_parser

# The engine's stop reasons that mean "cut short" to OpenAI; every other one is a natural stop.
LENGTH_REASONS = {"max_new_tokens", "context_length"}


@dataclass
class ReplyTotals:
    """What the reply came to, for the last chunk and the non-streamed message."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str | None = None

    @property
    def finish_reason(self) -> str:
        if self.calls:
            return "tool_calls"
        return "length" if self.stop_reason in LENGTH_REASONS else "stop"

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class ReplyReader:
    """Feed it a job's results in order (:meth:`feed`); each gives the delta to send."""

    def __init__(
        self,
        tokenizer,
        tool_format: str | None = None,
        forced_call: str | None = None,
        split_reasoning: bool = True,
    ) -> None:
        """``tool_format``: read tool calls in this format (None: no tools offered).
        ``forced_call``: the output is the arguments of this function (constrained), or with
        ``"*"`` a ``{"name", "arguments"}`` object for any of them."""
        self.totals = ReplyTotals()
        self._forced = forced_call
        self._held: list[str] = []
        self._parser = make_parser(tool_format) if tool_format and forced_call is None else None
        harmony_parser = self._parser is not None and self._parser.name == "harmony"
        self._splitter = reply_splitter(tokenizer) if split_reasoning and not harmony_parser else None
        self._markers: dict[int, str] = {}
        if self._parser is not None:
            for marker in self._parser.markers:
                token = tokenizer.token_to_id(marker)
                # Only markers the generator's text leaves out (special tokens) are written back.
                if token is not None and tokenizer.decode([token]) == "":
                    self._markers[token] = marker

    def feed(self, result: JobResult) -> ParsedDelta:
        t = self.totals
        t.prompt_tokens, t.completion_tokens = result.prompt_tokens, result.new_tokens
        if result.done:
            t.stop_reason = result.stop_reason
        delta = self._read(result)
        t.content.append(delta.content)
        t.reasoning.append(delta.reasoning)
        t.calls += delta.calls
        return delta

    def _read(self, result: JobResult) -> ParsedDelta:
        if self._forced is not None:
            self._held.append(result.text)
            return self._forced_call() if result.done else ParsedDelta()
        if self._parser is not None:
            marked = result.text + "".join(self._markers.get(t, "") for t in result.token_ids)
            delta = self._parser.feed(marked)
            return delta + self._parser.finish() if result.done else delta
        if self._splitter is not None:
            parts = self._splitter.feed(result.text, result.token_ids)
            if result.done:
                parts = parts + self._splitter.finish()
            return ParsedDelta(content=parts.answer, reasoning=parts.reasoning)
        return ParsedDelta(content=result.text)

    def _forced_call(self) -> ParsedDelta:
        text = "".join(self._held)
        try:
            value = json.loads(text)
        except ValueError:
            return ParsedDelta(content=text)  # cut short (length): the text is what there is
        if self._forced == "*":
            call = call_from_object(value)
        elif isinstance(value, dict):
            call = ToolCall(self._forced, json.dumps(value, ensure_ascii=False))
        else:
            call = None
        return ParsedDelta(calls=[call]) if call is not None else ParsedDelta(content=text)
