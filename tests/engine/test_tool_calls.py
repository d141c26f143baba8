"""Tool-call parsers (engine.tool_calls): each format on sample replies, whole and cut into
streamed pieces of every size, plus format detection and the prompt of a template without tools."""

from __future__ import annotations

import json

import pytest

from engine.tool_calls import PARSERS, ParsedDelta, detect_format, make_parser
from engine.tool_calls.prompt import tool_prompt


def run(fmt: str, pieces: list[str]) -> ParsedDelta:
    """Feed ``pieces`` and finish; content deltas come before any call (harmony's messages may
    follow one another in any order)."""
    parser = make_parser(fmt)
    total = ParsedDelta()
    for piece in pieces:
        delta = parser.feed(piece)
        assert fmt == "harmony" or not (total.calls and delta.content), "content after a call was streamed"
        total += delta
    return total + parser.finish()


def cuts(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def check_all_cuts(fmt: str, text: str) -> ParsedDelta:
    """The reply read whole, and the same read from pieces of every size, agree."""
    whole = run(fmt, [text])
    for size in range(1, len(text) + 1):
        got = run(fmt, cuts(text, size))
        assert got.content == whole.content, size
        assert got.reasoning == whole.reasoning, size
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
            (c.name, json.loads(c.arguments)) for c in whole.calls
        ], size
    return whole


def names_and_args(delta: ParsedDelta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in delta.calls]


# -- Hermes / Qwen ------------------------------------------------------------------------------


def test_hermes_text_then_two_calls():
    reply = (
        "Let me check both.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    got = check_all_cuts("hermes", reply)
    assert got.content == "Let me check both."
    assert names_and_args(got) == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]


def test_hermes_streams_text_before_the_call_at_once():
    parser = make_parser("hermes")
    assert parser.feed("Sure, <tool").content == "Sure, "  # "<tool" may open a call: held
    assert parser.feed("_call>{").content == ""
    assert parser.feed('"name": "f", "arguments": {}}</tool_call>') == ParsedDelta()
    end = parser.finish()
    assert names_and_args(end) == [("f", {})]


def test_hermes_held_text_that_is_no_call_is_released():
    parser = make_parser("hermes")
    assert parser.feed("a <to").content == "a "
    assert parser.feed("p> b").content == "<top> b"


def test_hermes_unclosed_call_at_the_end_is_still_read():
    got = run("hermes", ['<tool_call>{"name": "f", "arguments": {"x": 1}}'])
    assert names_and_args(got) == [("f", {"x": 1})] and got.content == ""


def test_hermes_broken_json_stays_text():
    reply = "<tool_call>{not json}</tool_call>"
    got = run("hermes", [reply])
    assert got.calls == [] and got.content == reply


def test_hermes_arguments_as_json_text_are_read():
    got = run("hermes", ['<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'])
    assert names_and_args(got) == [("f", {"a": [1, 2]})]


def test_plain_reply_has_no_calls():
    got = check_all_cuts("hermes", "Paris is the capital of France. 1 < 2 and <b>bold</b>.")
    assert got.calls == [] and got.content == "Paris is the capital of France. 1 < 2 and <b>bold</b>."


# -- Llama 3 --------------------------------------------------------------------------------------


def test_llama3_bare_json_call():
    got = check_all_cuts("llama3", '  {"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert names_and_args(got) == [("get_weather", {"city": "Oslo"})] and got.content == ""


def test_llama3_python_tag_and_several_calls():
    reply = 'Checking.<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": true}}'
    got = check_all_cuts("llama3", reply)
    assert got.content == "Checking."
    assert names_and_args(got) == [("a", {}), ("b", {"x": True})]


def test_llama3_json_answer_is_not_a_call():
    answer = '{"name": "Ada", "age": 36}'
    got = check_all_cuts("llama3", answer)
    assert got.calls == [] and got.content == answer


# -- Mistral --------------------------------------------------------------------------------------


def test_mistral_json_list():
    reply = '[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {}}]'
    got = check_all_cuts("mistral", reply)
    assert names_and_args(got) == [("f", {"q": "x"}), ("g", {})] and got.content == ""


def test_mistral_name_args_format_with_call_ids():
    reply = 'Ok.[TOOL_CALLS]f[ARGS]{"q": "x"}[TOOL_CALLS]g[CALL_ID]abc123XYZ[ARGS]{}'
    got = check_all_cuts("mistral", reply)
    assert got.content == "Ok."
    assert names_and_args(got) == [("f", {"q": "x"}), ("g", {})]
    assert got.calls[1].id == "abc123XYZ"


# -- gpt-oss harmony ------------------------------------------------------------------------------


def test_harmony_reasoning_then_call():
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    got = check_all_cuts("harmony", reply)
    assert got.reasoning == "Need the weather." and got.content == ""
    assert names_and_args(got) == [("get_weather", {"city": "Paris"})]


def test_harmony_recipient_before_the_channel_and_a_final_answer():
    reply = (
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"id": 7}<|call|>'
        "<|start|>assistant<|channel|>final<|message|>Found it.<|return|>"
    )
    got = check_all_cuts("harmony", reply)
    assert names_and_args(got) == [("lookup", {"id": 7})] and got.content == "Found it."


def test_harmony_answer_streams_as_content():
    parser = make_parser("harmony")
    assert parser.feed("<|channel|>final<|message|>Hel").content == "Hel"
    assert parser.feed("lo").content == "lo"


def test_harmony_without_markers_is_all_content():
    assert run("harmony", ["just text"]).content == "just text"


# -- Gemma ----------------------------------------------------------------------------------------


def test_functiongemma_call_with_escaped_strings_and_nesting():
    reply = (
        "<start_function_call>call:book{city:<escape>Paris, {France}<escape>,nights:3,"
        "vip:true,tags:[<escape>a<escape>,2],room:{beds:2}}<end_function_call>"
    )
    got = check_all_cuts("functiongemma", reply)
    assert names_and_args(got) == [
        ("book", {"city": "Paris, {France}", "nights": 3, "vip": True, "tags": ["a", 2], "room": {"beds": 2}})
    ]


def test_pythonic_list_of_calls_and_fenced_form():
    got = check_all_cuts("pythonic", '[get_weather(city="Paris", days=2), get_time(zone=None)]')
    assert names_and_args(got) == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": None}),
    ]
    fenced = check_all_cuts("pythonic", "```tool_code\n[f(x=[1, 2])]\n```")
    assert names_and_args(fenced) == [("f", {"x": [1, 2]})]


def test_pythonic_never_runs_code():
    reply = "[__import__('os').system('echo hi')]"
    got = run("pythonic", [reply])
    assert got.calls == [] and got.content == reply


def test_pythonic_plain_answer_and_list_answer():
    assert run("pythonic", ["Hello"]).content == "Hello"
    assert run("pythonic", ["[1, 2, 3] are numbers"]).content == "[1, 2, 3] are numbers"


# -- detection and prompts ----------------------------------------------------------------------


class _Vocab:
    def __init__(self, tokens: set[str], template: str) -> None:
        self.tokens, self.chat_template = tokens, template

    def token_to_id(self, token: str):
        return hash(token) % 1000 if token in self.tokens else None


@pytest.mark.parametrize(
    ("tokens", "template", "expected"),
    [
        ({"<|channel|>", "<|call|>"}, "x", "harmony"),
        ({"<start_function_call>"}, "x", "functiongemma"),
        ({"[TOOL_CALLS]"}, "x", "mistral"),
        (set(), "{% if tools %}<tool_call>{% endif %}", "hermes"),
        ({"<|python_tag|>"}, "<|start_header_id|>", "llama3"),
        (set(), "<start_of_turn>user", "pythonic"),
        (set(), "<|im_start|>", "hermes"),
    ],
)
def test_detect_format(tokens, template, expected):
    assert detect_format(_Vocab(tokens, template)) == expected


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_template_with_tools_gets_them_as_transformers_passes_them():
    messages = [{"role": "user", "content": "hi"}]
    prompt = tool_prompt(messages, TOOLS, "llama3", "{% for t in tools %}{{ t }}{% endfor %}")
    assert prompt.template_args == {"tools": TOOLS} and prompt.messages == messages
    assert prompt.format == "llama3"


def test_template_without_tools_describes_them_and_inlines_history():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    prompt = tool_prompt(messages, TOOLS, "mistral", "{{ messages }}")
    assert prompt.format == "hermes"  # mistral has no prompt of its own: Hermes is described
    assert prompt.template_args == {}
    system, user, assistant, results = prompt.messages
    assert (
        system["role"] == "system"
        and '"name": "f"' in system["content"]
        and "<tool_call>" in system["content"]
    )
    assert assistant == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    }
    assert results["role"] == "user" and "sunny" in results["content"] and "warm" in results["content"]
    # What the assistant turn holds is what the hermes parser reads back.
    assert names_and_args(run("hermes", [assistant["content"]])) == [("f", {"x": 1})]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_each_format_reads_back_the_calls_it_writes(fmt):
    parser = make_parser(fmt)
    args = {"city": "Paris", "n": 2, "ok": True}
    written = parser.format_call("get_weather", args)
    if fmt == "harmony":  # a harmony call is a message, not a line: written by the template
        written = f"<|channel|>commentary to=functions.get_weather<|message|>{json.dumps(args)}<|call|>"
    assert names_and_args(run(fmt, [written])) == [("get_weather", args)]
