"""The ASGI application (Starlette): routes, the API key check, and errors in OpenAI's shape.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /health``. With an API key set, every ``/v1`` route wants
``Authorization: Bearer KEY`` (401 otherwise); ``/health`` stays open for load balancers and
supervisors, and says nothing about the model.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serve.errors import APIError

if TYPE_CHECKING:
    from engine.serve.server import OpenAIServer

log = logging.getLogger("engine.serve")


class ApiKeyMiddleware:
    """Refuses ``/v1`` requests without ``Authorization: Bearer <key>`` (pure ASGI: it never
    touches a streamed response)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(
                    401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key"
                )
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        log.error("%s %s: %s", request.method, request.url.path, exc.message)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=code))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path)
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def build_app(server: OpenAIServer) -> Starlette:
    from engine.serve.chat import chat_completions
    from engine.serve.completions import completions

    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "trellis"}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in server.model_ids]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        server.check_model(name)
        return JSONResponse(model_card(name))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "running": server.engine.active_requests})

    async def chat(request: Request) -> Response:
        return await chat_completions(server, request)

    async def complete(request: Request) -> Response:
        return await completions(server, request)

    app = Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    if server.options.api_key:
        app.add_middleware(ApiKeyMiddleware, key=server.options.api_key)
    return app
