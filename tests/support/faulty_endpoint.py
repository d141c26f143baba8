"""A deliberately faulty OpenAI-compatible endpoint for the remote-engine tests (Starlette on
uvicorn, in a thread of the test process, on a free port of 127.0.0.1).

The model id picks the behaviour: ``good`` streams ``REPLY`` word by word; ``drop`` streams
``PARTIAL`` then cuts the connection (no final chunk, no ``[DONE]``); ``slow`` waits
``SLOW_FIRST_BYTE_S`` before the first byte, then answers like ``good``; ``busy`` answers 429
with ``Retry-After: 7``; ``broken`` answers 500; ``tools`` calls the ``add`` tool (streamed in
pieces) and, once given its result, says it. Every request needs ``Authorization: Bearer KEY``
(401 otherwise). ``requests`` records each request's JSON body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

KEY = "test-key"
MODELS = ("good", "drop", "slow", "busy", "broken", "tools")
REPLY = "The quick brown fox jumps over the lazy dog."
PARTIAL = "This reply will be cut"
SLOW_FIRST_BYTE_S = 1.0


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    event: dict = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        event = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
    return f"data: {json.dumps(event)}\n\n".encode()


class FaultyEndpoint:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self._server: uvicorn.Server | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {KEY}":
                return JSONResponse({"error": {"message": "bad key"}}, 401)
            return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]})

        async def chat(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {KEY}":
                return JSONResponse({"error": {"message": "invalid API key"}}, 401)
            body = await request.json()
            self.requests.append(body)
            model = body["model"]
            if model == "busy":
                return JSONResponse({"error": {"message": "slow down"}}, 429, headers={"Retry-After": "7"})
            if model == "broken":
                return JSONResponse({"error": {"message": "GPU on fire"}}, 500)

            async def words(text: str):
                for i, word in enumerate(text.split(" ")):
                    yield _chunk({"content": word if i == 0 else " " + word})
                    await asyncio.sleep(0.01)

            async def events():
                if model == "slow":
                    await asyncio.sleep(SLOW_FIRST_BYTE_S)
                if model == "drop":
                    async for piece in words(PARTIAL):
                        yield piece
                    raise RuntimeError("connection cut on purpose")
                if model == "tools" and not any(m["role"] == "tool" for m in body["messages"]):
                    call = {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": ""},
                    }
                    yield _chunk({"tool_calls": [call]})
                    for piece in ('{"a": 2,', ' "b": 3}'):
                        yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                    yield _chunk({}, "tool_calls")
                else:
                    results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
                    async for piece in words(f"The sum is {results[-1]}." if results else REPLY):
                        yield piece
                    yield _chunk({}, "stop")
                yield _chunk({}, usage={"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(
            routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])]
        )

    def __enter__(self) -> FaultyEndpoint:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.should_exit = True
        self._thread.join(5)
