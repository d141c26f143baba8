"""Errors as OpenAI's API reports them: an HTTP status and ``{"error": {message, type, param, code}}``.

Clients (the ``openai`` package, editor plugins) read that object to show the reason, so every
refusal the server makes has this shape, and none is a 500: a request the engine refuses (a bad
sampling value, a prompt longer than the context, an unreadable image, a schema the constraint
compiler cannot honour) is the request's fault and gets a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ContextOverflowError, EngineError, SamplingSettingError


class APIError(Exception):
    """A refusal to send back as an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: Exception) -> APIError:
    """The API error for an exception the engine raised while taking a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingSettingError):
        return bad_request(str(exc), param=exc.field)
    if isinstance(exc, ContextOverflowError):
        return bad_request(str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, EngineError):
        return bad_request(str(exc))
    # A bug or a broken model: the server's fault, said as such (the server stays up).
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
