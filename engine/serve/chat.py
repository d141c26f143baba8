"""``POST /v1/chat/completions``: a chat reply, whole or streamed as server-sent events."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.serve.body import read_body
from engine.serve.errors import APIError, bad_request
from engine.serve.jobs import JobStream
from engine.serve.messages import convert_messages
from engine.serve.reply import ReplyReader
from engine.serve.sampling import read_sampling
from engine.serve.schemas import ChatRequest, parse_body
from engine.serve.server import OpenAIServer
from engine.serve.sse import DONE, event
from engine.serve.tools import plan_tools
from engine.tool_calls import PARSERS, ParsedDelta
from engine.tool_calls.prompt import tool_prompt


async def chat_completions(server: OpenAIServer, request: Request) -> Response:
    req = parse_body(await read_body(request, server.options.max_body_bytes), ChatRequest)
    server.check_model(req.model)
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not supported by this server", param="logprobs")
    budget = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = read_sampling(req, budget)
    plan = plan_tools(req.tools, req.tool_choice, req.response_format)
    messages, images = convert_messages(req.messages, server.allowed_dirs)
    if images and not server.session.sees_images:
        raise bad_request(f"{server.model_name} cannot see images (it has no vision tower)", param="messages")
    prompt = tool_prompt(messages, plan.tools, server.tool_format, server.tokenizer.chat_template)
    fmt = prompt.format if plan.read_calls else None
    stop_markers = PARSERS[fmt].stop_markers if fmt else ()
    stream = JobStream(
        server.engine,
        server.chat_job(prompt.messages, prompt.template_args, images, sampling, plan.schema, stop_markers),
    )
    await stream.accepted()
    reader = ReplyReader(server.tokenizer, fmt, plan.forced)
    reply = _Reply(server.model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _events(stream, reader, reply, include_usage), media_type="text/event-stream"
        )
    await stream.collect(request, reader.feed)
    return JSONResponse(reply.whole(reader))


class _Reply:
    """The envelope every chunk and the whole reply share."""

    def __init__(self, model: str) -> None:
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model

    def whole(self, reader: ReplyReader) -> dict[str, Any]:
        t = reader.totals
        message: dict[str, Any] = {"role": "assistant", "content": "".join(t.content)}
        if t.calls:
            message["tool_calls"] = [c.to_openai() for c in t.calls]
            message["content"] = message["content"].strip() or None
        if "".join(t.reasoning):
            message["reasoning_content"] = "".join(t.reasoning)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "finish_reason": t.finish_reason, "logprobs": None}],
            "usage": t.usage(),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None, usage: bool = False) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if usage:
            out["usage"] = None  # OpenAI's: null on every chunk but the last, when asked for
        return out


def _delta(parsed: ParsedDelta, first_call: int) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        delta["tool_calls"] = [c.to_openai(first_call + i) for i, c in enumerate(parsed.calls)]
    return delta


async def _events(
    stream: JobStream, reader: ReplyReader, reply: _Reply, include_usage: bool
) -> AsyncIterator[str]:
    yield event(reply.chunk({"role": "assistant", "content": ""}, usage=include_usage))
    calls = 0
    try:
        async for result in stream.results():
            parsed = reader.feed(result)
            delta = _delta(parsed, calls)
            calls += len(parsed.calls)
            if delta:
                yield event(reply.chunk(delta, usage=include_usage))
    except APIError as exc:  # a failed step after the 200 went out: say so in the stream
        yield event(exc.body())
        yield DONE
        return
    finally:
        stream.close()  # the client went away mid-stream: the job leaves the batch
    yield event(reply.chunk({}, reader.totals.finish_reason, usage=include_usage))
    if include_usage:
        yield event({**reply.chunk({}), "choices": [], "usage": reader.totals.usage()})
    yield DONE
