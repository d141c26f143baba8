"""ToolChat: a chat session's tool prompt and the calls read out of its streamed chunks."""

from __future__ import annotations

import json

from engine.api import StreamChunk
from engine.tool_calls.chat_stream import ToolChat, has_tool_history

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


class NoToolsTemplateTokenizer:
    """A tokenizer whose template knows no tools and whose vocabulary has no tool markers."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def token_to_id(self, token: str) -> None:
        return None

    def decode(self, ids: list[int]) -> str:
        return ""


def test_calls_leave_the_text_and_arrive_whole_on_their_chunk():
    chat = ToolChat(NoToolsTemplateTokenizer(), [ADD])
    assert chat.format == "hermes"
    pieces = ["Sure. <tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}</tool_call>', ""]
    chunks = [chat.read(StreamChunk(p, [], done=i == len(pieces) - 1)) for i, p in enumerate(pieces)]
    assert "".join(c.text for c in chunks).strip() == "Sure."
    calls = [call for c in chunks for call in c.tool_calls]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}


def test_tools_and_history_go_into_the_prompt_in_the_models_format():
    chat = ToolChat(NoToolsTemplateTokenizer(), [ADD])
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    history = [
        {"role": "user", "content": "1?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    assert has_tool_history(history) and not has_tool_history(history[:1])
    shaped = chat.messages(history)
    assert shaped[0]["role"] == "system" and '"name": "add"' in shaped[0]["content"]
    assert "<tool_call>" in shaped[2]["content"] and '"a": 1' in shaped[2]["content"]
    assert shaped[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}


def test_without_tools_offered_the_text_is_left_alone():
    chat = ToolChat(NoToolsTemplateTokenizer(), [])
    chunk = StreamChunk('<tool_call>{"name": "add", "arguments": {}}</tool_call>', [], done=True)
    assert chat.read(chunk) is chunk
