"""The server over a scripted generator (tests/support/scripted_engine.py): replies known in
advance, so the tool-call path of tool_choice "auto" (the model's text -> the format's parser ->
``tool_calls`` in the response and the stream), the API key and client disconnects are tested
through HTTP without depending on what the starter model would write. The tokenizer, and so the
prompts, are the starter model's."""

from __future__ import annotations

import json
import time

import httpx2
import openai
import pytest
from scripted_engine import scripted_session

from engine.serve.runner import BackgroundServer
from engine.serve.server import OpenAIServer, ServeOptions

pytestmark = pytest.mark.slow  # the starter model's import, for its tokenizer

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_REPLY = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_dir)


def serve(tokenizer, script, **options):
    session = scripted_session(tokenizer, script)
    return session, BackgroundServer(OpenAIServer(session, ServeOptions(**options)))


def ask_weather(client, **kwargs):
    return client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL], **kwargs
    )


def test_auto_tool_call_whole_and_streamed(tokenizer):
    session, background = serve(tokenizer, lambda job: pieces(CALL_REPLY))
    with background as bg:
        client = openai.OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
        reply = ask_weather(client)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert call.id.startswith("call_") and call.type == "function"

        chunks = list(ask_weather(client, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert content == "Let me check."
        # No piece of the call's markup leaked into the streamed content on the way.
        assert all("<" not in (c.choices[0].delta.content or "") for c in chunks)
        calls = [tc for c in chunks if c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
            (0, "get_weather", {"city": "Paris"})
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # SmolLM2's template knows no tools: the prompt describes them, in the format read back.
    prompt = tokenizer.decode(session.generator.seen[0].input_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt


def test_tool_choice_none_reads_no_calls(tokenizer):
    session, background = serve(tokenizer, lambda job: pieces(CALL_REPLY))
    with background as bg:
        client = openai.OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
        reply = ask_weather(client, tool_choice="none")
    assert reply.choices[0].message.content == CALL_REPLY and not reply.choices[0].message.tool_calls
    prompt = tokenizer.decode(session.generator.seen[0].input_ids)
    assert "get_weather" not in prompt


def test_api_key(tokenizer):
    _, background = serve(tokenizer, lambda job: ["fine"], api_key="s3cret")
    with background as bg:
        for key in ("wrong", "s3cret-and-more"):
            with pytest.raises(openai.AuthenticationError) as caught:
                openai.OpenAI(base_url=bg.base_url, api_key=key, max_retries=0).models.list()
            assert caught.value.status_code == 401
            assert caught.value.body["code"] == "invalid_api_key"
        response = httpx2.post(bg.base_url + "/chat/completions", content=b"{}", timeout=30)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        client = openai.OpenAI(base_url=bg.base_url, api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["scripted"]
        reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "fine"
        health = httpx2.get(bg.base_url.removesuffix("/v1") + "/health", timeout=30)
        assert health.status_code == 200  # open: says nothing about the model


def test_a_client_that_goes_away_frees_its_job(tokenizer):
    session, background = serve(tokenizer, lambda job: ["tick "] * 100_000)
    with background as bg:
        client = openai.OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "count"}], stream=True
        )
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
        deadline = time.monotonic() + 10
        while session.generator.num_remaining_jobs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert session.generator.num_remaining_jobs == 0
        assert bg.server.engine.active_requests == 0


def test_a_client_that_times_out_on_a_whole_reply_frees_its_job(tokenizer):
    session, background = serve(tokenizer, lambda job: ["tick "] * 100_000)
    with background as bg:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "count"}]}
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(bg.base_url + "/chat/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 10
        while session.generator.num_remaining_jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session.generator.num_remaining_jobs == 0 and len(session.generator.seen) == 1


def test_usage_counts_what_the_generator_reports(tokenizer):
    _, background = serve(tokenizer, lambda job: ["Hello", " there", "!"])
    with background as bg:
        client = openai.OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="scripted", messages=messages, max_tokens=7)
    assert reply.choices[0].message.content == "Hello there!"
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(messages, add_generation_prompt=True))
    assert reply.usage.completion_tokens == len(tokenizer.encode("Hello there!", add_special_tokens=False))
