"""The OpenAI-compatible server with the starter model (SmolLM2-135M-Instruct), through the
official ``openai`` client against the server running in this process on a free port."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx2
import jsonschema
import openai
import pytest

from engine.serve.runner import BackgroundServer
from engine.serve.server import OpenAIServer, ServeOptions

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def served(smollm2_dir, media_dir):
    from engine.session import ChatSession

    session = ChatSession.load(smollm2_dir, device="cpu", cache_tokens=4096)
    server = OpenAIServer(session, ServeOptions(allowed_media_dirs=[media_dir], default_max_tokens=64))
    with BackgroundServer(server) as bg:
        yield server, bg


@pytest.fixture(scope="module")
def client(served):
    _, bg = served
    return openai.OpenAI(base_url=bg.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(served):
    return served[0].model_name


def post(served, path: str, body: bytes | dict, headers: dict | None = None) -> httpx2.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(served[1].base_url + path, content=data, headers=headers or {}, timeout=120)


def chat(client, model, messages=QUESTION, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model


def test_chat_usage_counts_are_the_tokenizers(client, model, served):
    tokenizer = served[0].tokenizer
    reply = chat(client, model, max_tokens=6)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION, add_generation_prompt=True))
    assert reply.usage.completion_tokens == 6
    assert reply.usage.completion_tokens == len(
        tokenizer.encode(choice.message.content, add_special_tokens=False)
    )
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_streamed_chat_matches_the_whole_reply(client, model):
    whole = chat(client, model, max_tokens=24).choices[0].message.content
    assert "Paris" in whole
    chunks = list(chat(client, model, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # really streamed


def test_stop_is_honoured(client, model):
    whole = chat(client, model, max_tokens=24).choices[0].message.content
    word = "France"
    assert word in whole
    reply = chat(client, model, max_tokens=24, stop=[word])
    assert reply.choices[0].message.content == whole[: whole.index(word)]
    assert reply.choices[0].finish_reason == "stop"


def test_text_completion_whole_and_streamed(client, model):
    whole = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    streamed = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "capital"],
}


def test_json_schema_output_is_valid_for_20_seeds(client, model):
    def ask(seed: int):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Give me a city as JSON."}],
            temperature=1.0,
            seed=seed,
            max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        )

    with ThreadPoolExecutor(8) as pool:  # in one batch, as clients would send them
        replies = list(pool.map(ask, range(20)))
    texts = []
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        value = json.loads(reply.choices[0].message.content)
        jsonschema.validate(value, SCHEMA)
        texts.append(reply.choices[0].message.content)
    assert len(set(texts)) > 1  # the seeds did sample differently
    again = ask(3).choices[0].message.content
    assert again == texts[3]  # and a seed repeats its reply


def test_json_object_mode(client, model):
    reply = chat(client, model, max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_tool_call_round_trip(client, model):
    """tool_choice names the function: the reply is constrained to its arguments' schema and
    comes back as a tool call; the call and its result then go back for the answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(client, model, messages, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=40)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})},
    ]
    answer = chat(client, model, messages, tools=[WEATHER_TOOL], max_tokens=40)
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_tool_choice_picks_among_the_tools(client, model):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = chat(client, model, messages, tools=[WEATHER_TOOL, other], tool_choice="required", max_tokens=40)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_streamed_forced_tool_call(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    chunks = list(
        chat(client, model, messages, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=40, stream=True)
    )
    calls = [
        tc
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for tc in c.choices[0].delta.tool_calls
    ]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about rain.",
    "What is 2+2?",
    "Tell me a joke.",
    "Who wrote Hamlet?",
    "Describe a cat.",
    "What is Python?",
]


def test_concurrent_streams_equal_the_same_requests_one_at_a_time(client, model):
    def streamed(prompt: str) -> tuple[str, int]:
        messages = [{"role": "user", "content": prompt}]
        options = {"include_usage": True}
        chunks = list(chat(client, model, messages, max_tokens=16, stream=True, stream_options=options))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[
            -1
        ].usage.completion_tokens

    alone = [streamed(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(streamed, PROMPTS))
    assert together == alone
    assert all(tokens > 0 for _, tokens in alone)


def error_of(response: httpx2.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "no-such-model", "messages": QUESTION}, 404, "model"),
        ({"messages": QUESTION}, 400, "model"),
        ({"model": "MODEL", "messages": QUESTION, "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "MODEL", "messages": QUESTION, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ({"model": "MODEL", "messages": QUESTION, "n": 2}, 400, "n"),
        ({"model": "MODEL", "messages": QUESTION, "temperature": 3}, 400, "temperature"),
        ({"model": "MODEL", "messages": QUESTION, "seed": -1}, 400, "seed"),
        ({"model": "MODEL", "messages": QUESTION, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"model": "MODEL", "messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "MODEL", "messages": []}, 400, "messages"),
        ({"model": "MODEL", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ({"model": "MODEL", "messages": QUESTION, "tool_choice": "auto"}, 400, "tool_choice"),
        (
            {
                "model": "MODEL",
                "messages": QUESTION,
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            400,
            "tool_choice",
        ),
        (
            {"model": "MODEL", "messages": QUESTION, "response_format": {"type": "xml"}},
            400,
            "response_format",
        ),
        (
            {
                "model": "MODEL",
                "messages": QUESTION,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "email", "not": {}}},
                },
            },
            400,
            None,
        ),
        ({"model": "MODEL", "messages": QUESTION, "logprobs": True}, 400, "logprobs"),
        ({"model": "MODEL", "prompt": "hi", "echo": True}, 400, "echo"),
    ],
)
def test_invalid_requests_get_an_openai_error(served, model, body, status, param):
    path = "/completions" if isinstance(body, dict) and "prompt" in body else "/chat/completions"
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body = {**body, "model": model}
    response = post(served, path, body)
    assert response.status_code == status, response.text
    error = error_of(response)
    if param is not None:
        assert error["param"] == param


def test_a_10_mb_body_is_refused(served, model):
    big = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]})
    response = post(served, "/chat/completions", big.encode())
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    # The same without a Content-Length (chunked): refused while reading, not after.
    data = big.encode()
    chunks = iter([data[i : i + 65536] for i in range(0, len(data), 65536)])
    response = httpx2.post(served[1].base_url + "/chat/completions", content=chunks, timeout=120)
    assert response.status_code == 413


def test_a_prompt_longer_than_the_context_is_a_400(served, model):
    long = [{"role": "user", "content": "word " * 5000}]
    response = post(served, "/chat/completions", {"model": model, "messages": long})
    assert response.status_code == 400
    assert error_of(response)["code"] == "context_length_exceeded"


def test_unknown_routes_and_methods_are_openai_errors(served):
    response = httpx2.get(served[1].base_url + "/nothing-here", timeout=30)
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"
    response = httpx2.get(served[1].base_url + "/chat/completions", timeout=30)
    assert response.status_code == 405


PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def image_message(url: str) -> list[dict]:
    parts = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


def test_image_sources_follow_the_allowed_folders(served, model, media_dir, tmp_path):
    inside = media_dir / "dot.png"
    inside.write_bytes(PNG)
    outside = tmp_path / "dot.png"
    outside.write_bytes(PNG)
    cases = [
        ("data:image/png;base64," + base64.b64encode(PNG).decode(), 400, "cannot see images"),
        (str(inside), 400, "cannot see images"),  # read, then refused: a text-only model
        ("file://" + str(inside), 400, "cannot see images"),
        (str(outside), 403, "outside the folders"),
        (str(media_dir / ".." / outside.parent.name / "dot.png"), 403, "outside the folders"),
        ("https://example.com/cat.png", 400, "does not fetch"),
        ("data:image/png;base64,***", 400, "not valid base64"),
    ]
    for url, status, words in cases:
        response = post(served, "/chat/completions", {"model": model, "messages": image_message(url)})
        assert response.status_code == status, (url, response.text)
        assert words in error_of(response)["message"], url


def test_health_and_the_server_survives_bad_requests(served, client, model):
    post(served, "/chat/completions", b"\xff\xfe")
    response = httpx2.get(served[1].base_url.removesuffix("/v1") + "/health", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "ok"
    assert chat(client, model, max_tokens=2).usage.completion_tokens == 2
