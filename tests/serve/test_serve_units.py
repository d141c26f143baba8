"""Pieces of the server without a model: reading replies (marker tokens written back for the
tool-call parsers), the engine loop's routing and failures, image sources, tool plans."""

from __future__ import annotations

import base64
import json
import threading

import pytest
from scripted_engine import ScriptedGenerator

from engine.generation.job import Job, JobResult
from engine.serve.engine_loop import ACCEPTED, EngineClosedError, EngineLoop
from engine.serve.errors import APIError
from engine.serve.media import read_image, resolve_dirs
from engine.serve.reply import ReplyReader
from engine.serve.tools import plan_tools

HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]


class MarkerTokenizer:
    """Words are tokens; the harmony markers are special tokens that decode to nothing."""

    def __init__(self) -> None:
        self.ids = {m: 1000 + i for i, m in enumerate(HARMONY)}

    def token_to_id(self, token: str):
        return self.ids.get(token)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "" if all(i >= 1000 for i in ids) else "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def step(text: str, markers: list[str], tok: MarkerTokenizer, done: bool = False, n: int = 0) -> JobResult:
    ids = [ord(c) for c in text] + [tok.ids[m] for m in markers]
    return JobResult(None, text, ids, done, "eos" if done else None, prompt_tokens=3, new_tokens=n)


def harmony_steps(tok: MarkerTokenizer) -> list[JobResult]:
    # As the generator streams it: each step's text (markers decode to nothing), then its markers.
    return [
        step("", ["<|channel|>"], tok),
        step("analysis", ["<|message|>"], tok),
        step("Need weather.", ["<|end|>", "<|start|>"], tok),
        step("assistant", ["<|channel|>"], tok),
        step("commentary to=functions.get_weather ", ["<|constrain|>"], tok),
        step("json", ["<|message|>"], tok),
        step('{"city": "Paris"}', ["<|call|>"], tok, done=True, n=9),
    ]


def test_harmony_markers_are_written_back_for_the_tool_parser():
    tok = MarkerTokenizer()
    reader = ReplyReader(tok, tool_format="harmony")
    for result in harmony_steps(tok):
        reader.feed(result)
    t = reader.totals
    assert "".join(t.reasoning) == "Need weather." and "".join(t.content) == ""
    assert [(c.name, json.loads(c.arguments)) for c in t.calls] == [("get_weather", {"city": "Paris"})]
    assert t.finish_reason == "tool_calls" and t.usage() == {
        "prompt_tokens": 3,
        "completion_tokens": 9,
        "total_tokens": 12,
    }


def test_without_tools_a_harmony_reply_is_split_into_reasoning_and_answer():
    tok = MarkerTokenizer()
    reader = ReplyReader(tok)
    for result in [
        step("", ["<|channel|>"], tok),
        step("analysis", ["<|message|>"], tok),
        step("Think.", ["<|end|>", "<|start|>"], tok),
        step("assistant", ["<|channel|>"], tok),
        step("final", ["<|message|>"], tok),
        step("Answer.", ["<|return|>"], tok, done=True),
    ]:
        reader.feed(result)
    assert "".join(reader.totals.reasoning) == "Think." and "".join(reader.totals.content) == "Answer."
    assert reader.totals.finish_reason == "stop"


def test_a_forced_call_cut_short_stays_text():
    reader = ReplyReader(MarkerTokenizer(), forced_call="f")
    reader.feed(JobResult(None, '{"a": ', [1], True, "max_new_tokens"))
    assert reader.totals.calls == [] and reader.totals.finish_reason == "length"
    assert "".join(reader.totals.content) == '{"a": '


# -- the engine loop ---------------------------------------------------------------------------


class Collect:
    def __init__(self) -> None:
        self.items: list = []
        self.done = threading.Event()

    def __call__(self, item) -> None:
        self.items.append(item)
        if isinstance(item, BaseException) or (isinstance(item, JobResult) and item.done):
            self.done.set()


def scripted_loop(script) -> tuple[EngineLoop, ScriptedGenerator]:
    generator = ScriptedGenerator(MarkerTokenizer(), script)
    return EngineLoop(generator).start(), generator


def test_engine_loop_routes_each_jobs_results_to_its_sink():
    loop, _ = scripted_loop(lambda job: [f"{job.input_ids[0]}-{i}" for i in range(job.input_ids[0])])
    sinks = [Collect() for _ in range(3)]
    try:
        for n, sink in zip((2, 5, 3), sinks):
            loop.submit(lambda n=n: Job([n], 10), sink)
        for sink in sinks:
            assert sink.done.wait(10)
    finally:
        loop.close()
    for n, sink in zip((2, 5, 3), sinks):
        assert sink.items[0] is ACCEPTED
        assert [r.text for r in sink.items[1:]] == [f"{n}-{i}" for i in range(n)]


def test_engine_loop_reports_a_refused_job_and_a_failed_step_and_goes_on():
    loop, generator = scripted_loop(lambda job: ["a"] * 50)
    refused, running, later = Collect(), Collect(), Collect()
    try:
        loop.submit(lambda: Job([1], 0), refused)  # max_new_tokens 0: refused at enqueue
        assert refused.done.wait(10) and "max_new_tokens" in str(refused.items[-1])

        real_iterate = generator.iterate

        def broken():
            generator.iterate = real_iterate
            raise RuntimeError("step failed")

        generator.iterate = broken
        loop.submit(lambda: Job([1], 5), running)
        assert running.done.wait(10) and isinstance(running.items[-1], RuntimeError)
        loop.submit(lambda: Job([1], 5), later)  # the loop is still there for new jobs
        assert later.done.wait(10) and later.items[-1].done
    finally:
        loop.close()


def test_closing_the_loop_tells_waiting_jobs():
    loop, _ = scripted_loop(lambda job: ["a"] * 1_000_000)
    sink = Collect()
    loop.submit(lambda: Job([1], 5), sink)
    loop.close()
    assert sink.done.wait(10) and isinstance(sink.items[-1], EngineClosedError)
    with pytest.raises(EngineClosedError):
        loop.submit(lambda: Job([1], 5), Collect())


# -- image sources -------------------------------------------------------------------------------


def test_image_sources(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(b"png!")
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"secret")
    (allowed / "link.png").symlink_to(secret)
    dirs = resolve_dirs([allowed])
    assert read_image("data:image/png;base64," + base64.b64encode(b"png!").decode(), [], "p") == b"png!"
    assert read_image(str(allowed / "a.png"), dirs, "p") == b"png!"
    with pytest.raises(APIError) as caught:
        read_image(str(allowed / "link.png"), dirs, "p")  # a link inside that leads out
    assert caught.value.status == 403
    with pytest.raises(APIError) as caught:
        read_image(str(allowed / "a.png"), [], "p")  # no folder allowed at all
    assert caught.value.status == 400 and "not allowed" in caught.value.message
    for url in ("http://x/y.png", "ftp://x/y.png", "data:image/png,abc"):
        with pytest.raises(APIError):
            read_image(url, dirs, "p")


# -- tool plans ----------------------------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {}}}},
}
OTHER = {"type": "function", "function": {"name": "g"}}


def test_tool_plans():
    assert plan_tools(None, None, None).read_calls is False
    auto = plan_tools([TOOL], None, {"type": "json_object"})
    assert auto.read_calls and auto.schema == {"type": "object"} and auto.forced is None
    none = plan_tools([TOOL], "none", None)
    assert none.tools == [] and not none.read_calls
    named = plan_tools([TOOL, OTHER], {"type": "function", "function": {"name": "g"}}, None)
    assert named.forced == "g" and named.schema == {"type": "object"}
    required = plan_tools([TOOL, OTHER], "required", None)
    assert required.forced == "*" and [b["properties"]["name"] for b in required.schema["anyOf"]] == [
        {"const": "f"},
        {"const": "g"},
    ]
    for tools, choice, fmt in [
        ([{"type": "retrieval"}], None, None),
        ([TOOL], {"type": "function", "function": {"name": "h"}}, None),
        ([TOOL], "required", {"type": "json_object"}),
        (None, "auto", None),
    ]:
        with pytest.raises(APIError):
            plan_tools(tools, choice, fmt)
