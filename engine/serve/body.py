"""Reading a request body with a size limit: a client cannot make the server hold more than
``limit`` bytes of one request, whether it announces the size (Content-Length) or not."""

from __future__ import annotations

from starlette.requests import Request

from engine.serve.errors import APIError


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise _too_large(limit)  # refused before reading any of it
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
