"""RemoteSession against a deliberately faulty local endpoint (tests/support/faulty_endpoint.py):
what arrives, what each failure says, and that Stop never waits for the network."""

from __future__ import annotations

import re
import socket
import time

import pytest
from faulty_endpoint import KEY, PARTIAL, REPLY, FaultyEndpoint
from memory_keyring import memory_keyring

from app.remote import session as remote
from app.remote.errors import RemoteError
from app.remote.keys import set_key
from app.remote.refs import make_ref
from app.remote.session import RemoteSession
from engine.api import GenerationRequest

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def endpoint():
    with FaultyEndpoint() as running:
        yield running


@pytest.fixture
def keys():
    with memory_keyring() as backend:
        yield backend


def session(endpoint, model: str) -> RemoteSession:
    return RemoteSession(endpoint.base_url, model, KEY)


def collect(sess: RemoteSession, request: GenerationRequest | None = None, messages=HELLO):
    chunks = []
    try:
        for chunk in sess.stream(messages, request or GenerationRequest()):
            chunks.append(chunk)
    except RemoteError as exc:
        return chunks, str(exc)
    return chunks, ""


def test_open_reads_the_key_from_the_keyring_and_checks_the_model(endpoint, keys):
    set_key(endpoint.base_url, KEY)
    opened = RemoteSession.open(make_ref(endpoint.base_url, "good"))
    assert opened.model_name == "good" and "127.0.0.1" in opened.device
    assert KEY not in repr(opened)
    with pytest.raises(RemoteError, match="does not serve the model 'nope'"):
        RemoteSession.open(make_ref(endpoint.base_url, "nope"))


def test_open_without_the_key_says_the_key_was_refused(endpoint, keys):
    with pytest.raises(RemoteError, match=r"refused the API key \(HTTP 401\)"):
        RemoteSession.open(make_ref(endpoint.base_url, "good"))


def test_a_good_stream_gives_the_text_and_the_servers_counts(endpoint):
    chunks, error = collect(session(endpoint, "good"))
    assert not error
    assert "".join(c.text for c in chunks) == REPLY
    last = chunks[-1]
    assert last.done and last.stop_reason == "eos"
    assert (last.prompt_tokens, last.new_tokens) == (11, 9)
    assert last.tokens_per_second > 0


def test_request_body_carries_sampling_images_tools_and_schema(endpoint):
    request = GenerationRequest(
        {"temperature": 0.3, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "seed": 4},
        max_new_tokens=33,
        stop_strings=("END",),
        json_schema='{"type": "object"}',
        tools=({"type": "function", "function": {"name": "add"}},),
    )
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 10
    messages = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Look", "images": [png]},
    ]
    collect(session(endpoint, "good"), request, messages)
    body = endpoint.requests[-1]
    assert body["max_tokens"] == 33 and body["stop"] == ["END"] and body["stream"] is True
    assert body["temperature"] == 0.3 and body["top_p"] == 0.9 and body["seed"] == 4 and body["min_p"] == 0.05
    assert "top_k" not in body  # off: a strict server is not sent it
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert body["tools"][0]["function"]["name"] == "add"
    assert body["messages"][0] == {"role": "system", "content": "Be brief"}
    parts = body["messages"][1]["content"]
    assert parts[0] == {"type": "text", "text": "Look"}
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")


def test_streamed_tool_call_pieces_come_back_whole(endpoint):
    chunks, error = collect(session(endpoint, "tools"))
    assert not error
    (call,) = chunks[-1].tool_calls
    assert call["id"] == "call_1" and call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    history = [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    chunks, _ = collect(session(endpoint, "tools"), messages=history)
    assert "".join(c.text for c in chunks) == "The sum is 5."
    assert endpoint.requests[-1]["messages"][2]["tool_call_id"] == "call_1"


def test_a_dropped_stream_keeps_what_arrived_and_says_so(endpoint):
    chunks, error = collect(session(endpoint, "drop"))
    assert "".join(c.text for c in chunks) == PARTIAL
    assert "dropped mid-reply" in error or "ended before the reply did" in error


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("busy", r"rate-limiting requests \(HTTP 429\) \(slow down\)\. Try again in 7 s"),
        ("broken", r"server error \(HTTP 500\) \(GPU on fire\)"),
    ],
)
def test_http_errors_are_named(endpoint, model, expected):
    chunks, error = collect(session(endpoint, model))
    assert not chunks
    assert re.search(expected, error), error


def test_wrong_key_mid_session(endpoint):
    _, error = collect(RemoteSession(endpoint.base_url, "good", "wrong"))
    assert "refused the API key (HTTP 401)" in error and "wrong" not in error


def test_slow_first_byte_within_the_limit_arrives(endpoint):
    chunks, error = collect(session(endpoint, "slow"))
    assert not error and "".join(c.text for c in chunks) == REPLY


def test_slow_first_byte_past_the_limit_is_named(endpoint, monkeypatch):
    monkeypatch.setattr(remote, "FIRST_BYTE_TIMEOUT_S", 0.3)
    _, error = collect(session(endpoint, "slow"))
    assert "sent nothing within 0.3 s" in error


def test_stop_while_the_server_is_silent_returns_at_once(endpoint):
    stopped_at = time.perf_counter() + 0.2
    started = time.perf_counter()
    chunks = list(
        session(endpoint, "slow").stream(HELLO, GenerationRequest(), lambda: time.perf_counter() > stopped_at)
    )
    assert chunks[-1].stop_reason == "cancelled"
    assert time.perf_counter() - started < 0.6  # the endpoint would wait 1 s before its first byte


def test_unreachable_endpoint():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    _, error = collect(RemoteSession(f"http://127.0.0.1:{port}/v1", "good"))
    assert error.startswith("cannot reach 127.0.0.1:")
