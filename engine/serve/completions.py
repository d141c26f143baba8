"""``POST /v1/completions``: continue a prompt (text, or token ids), whole or streamed."""

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
from engine.serve.reply import ReplyReader
from engine.serve.sampling import read_sampling
from engine.serve.schemas import CompletionRequest, parse_body
from engine.serve.server import OpenAIServer
from engine.serve.sse import DONE, event

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


def _prompt(req: CompletionRequest, vocab_size: int) -> str | list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        return prompt[0]
    if isinstance(prompt, list):
        if not prompt or any(not 0 <= t < vocab_size for t in prompt):
            raise bad_request(f"token ids must be in [0, {vocab_size})", param="prompt")
    return prompt


async def completions(server: OpenAIServer, request: Request) -> Response:
    req = parse_body(await read_body(request, server.options.max_body_bytes), CompletionRequest)
    server.check_model(req.model)
    if req.echo:
        raise bad_request("echo is not supported by this server", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    if req.logprobs:
        raise bad_request("logprobs are not supported by this server", param="logprobs")
    if req.best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", param="best_of")
    sampling = read_sampling(req, req.max_tokens)
    if sampling.max_tokens is None:
        sampling = type(sampling)(sampling.settings, DEFAULT_MAX_TOKENS, sampling.stops)
    prompt = _prompt(req, server.tokenizer.vocab_size)
    stream = JobStream(server.engine, server.completion_job(prompt, sampling))
    await stream.accepted()
    reader = ReplyReader(server.tokenizer, split_reasoning=False)
    envelope = {
        "id": "cmpl-" + secrets.token_hex(12),
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model_name,
        "system_fingerprint": None,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _events(stream, reader, envelope, include_usage), media_type="text/event-stream"
        )
    await stream.collect(request, reader.feed)
    t = reader.totals
    choice = {"index": 0, "text": "".join(t.content), "finish_reason": t.finish_reason, "logprobs": None}
    return JSONResponse({**envelope, "choices": [choice], "usage": t.usage()})


async def _events(
    stream: JobStream, reader: ReplyReader, envelope: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        out = {**envelope, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        return {**out, "usage": None} if include_usage else out

    try:
        async for result in stream.results():
            parsed = reader.feed(result)
            if parsed.content:
                yield event(chunk(parsed.content, None))
    except APIError as exc:
        yield event(exc.body())
        yield DONE
        return
    finally:
        stream.close()
    yield event(chunk("", reader.totals.finish_reason))
    if include_usage:
        yield event({**envelope, "choices": [], "usage": reader.totals.usage()})
    yield DONE
