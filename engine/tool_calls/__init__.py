"""Tool calls in a model's reply: from each family's own format to OpenAI's ``tool_calls``.

One parser per format (a module each); :func:`detect_format` picks the one a model speaks from
its vocabulary and chat template, :func:`make_parser` builds a fresh parser for one reply, and
:mod:`engine.tool_calls.prompt` puts the tools and earlier calls into the prompt. A parser is fed
the reply as it streams (``feed``, then ``finish``) and returns :class:`ParsedDelta` s: answer
text as soon as it is known not to be part of a call, and each call whole.

Formats (name: models; what a call looks like):

- hermes: Qwen 2.5/3, Hermes, models whose template knows no tools;
  ``<tool_call>{"name", "arguments"}</tool_call>``
- llama3: Llama 3.1 - 3.3; ``{"name", "parameters"}``, alone or after ``<|python_tag|>``
- mistral: Mistral, Mixtral, Nemo, Small, Magistral; ``[TOOL_CALLS][{...}]`` or
  ``[TOOL_CALLS]name[ARGS]{...}``
- harmony: gpt-oss; ``<|channel|>commentary to=functions.NAME ... <|message|>{...}<|call|>``
- functiongemma: FunctionGemma; ``<start_function_call>call:NAME{k:<escape>v<escape>}<end_function_call>``
- pythonic: Gemma 2/3 (as Google's guide prompts them), Llama 3.2/4; ``[name(k="v")]``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.tool_calls.base import ParsedDelta, ToolCall, ToolCallParser, call_from_object
from engine.tool_calls.gemma import FunctionGemmaParser
from engine.tool_calls.harmony import HarmonyParser
from engine.tool_calls.hermes import HermesParser
from engine.tool_calls.llama3 import Llama3JsonParser
from engine.tool_calls.mistral import MistralParser
from engine.tool_calls.pythonic import PythonicParser

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls
    for cls in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        HarmonyParser,
        FunctionGemmaParser,
        PythonicParser,
    )
}
FORMATS = ("auto", *PARSERS)


def detect_format(tokenizer: Tokenizer) -> str:
    """The tool-call format a model speaks, read off its vocabulary and chat template: the
    control tokens a family added for tool calls name it; without any, Gemma templates get the
    pythonic format Google's guide describes, and the rest Hermes (which is what the prompt of a
    template without tools then describes, :mod:`engine.tool_calls.prompt`)."""
    template = tokenizer.chat_template or ""

    def known(token: str) -> bool:
        return tokenizer.token_to_id(token) is not None or token in template

    if tokenizer.token_to_id("<|channel|>") is not None and tokenizer.token_to_id("<|call|>") is not None:
        return "harmony"
    if known("<start_function_call>"):
        return "functiongemma"
    if known("[TOOL_CALLS]"):
        return "mistral"
    if known("<tool_call>"):
        return "hermes"
    if known("<|python_tag|>") or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3"
    if "<start_of_turn>" in template:
        return "pythonic"
    return "hermes"


def make_parser(name: str) -> ToolCallParser:
    """A fresh parser (one per reply) for format ``name`` (one of :data:`PARSERS`)."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r} (known: {', '.join(PARSERS)})") from None


__all__ = [
    "FORMATS",
    "PARSERS",
    "ParsedDelta",
    "ToolCall",
    "ToolCallParser",
    "call_from_object",
    "detect_format",
    "make_parser",
]
