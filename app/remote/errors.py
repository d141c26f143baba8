"""What went wrong talking to a remote endpoint, as a message a user can act on.

Every failure becomes a :class:`RemoteError` (an ``EngineError``, so the worker reports it like
any engine failure: the reply keeps what arrived, the message says the rest).
"""

from __future__ import annotations

import json

import httpx2

from engine.errors import EngineError


class RemoteError(EngineError):
    """A remote endpoint failed; the text says how, for the user."""


def _server_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}}), else its start."""
    try:
        value = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:200]
    error = value.get("error") if isinstance(value, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:300]
    if isinstance(error, str):
        return error[:300]
    if isinstance(value, dict) and value.get("detail"):
        return str(value["detail"])[:300]
    return ""


def status_error(host: str, status: int, body: bytes, retry_after: str | None = None) -> RemoteError:
    said = _server_message(body)
    detail = f" ({said})" if said else ""
    if status in (401, 403):
        return RemoteError(
            f"{host} refused the API key (HTTP {status}){detail}. Check the key in Settings › Engines."
        )
    if status == 404:
        return RemoteError(f"{host} does not know this model or path (HTTP 404){detail}.")
    if status == 429:
        wait = f" Try again in {retry_after.strip()} s." if retry_after and retry_after.strip() else ""
        return RemoteError(f"{host} is rate-limiting requests (HTTP 429){detail}.{wait}")
    if status >= 500:
        return RemoteError(f"{host} failed with a server error (HTTP {status}){detail}. Try again later.")
    return RemoteError(f"{host} refused the request (HTTP {status}){detail}.")


def transport_error(host: str, exc: Exception, started: bool, first_byte_s: float) -> RemoteError:
    """A failure below HTTP: no connection, no answer in time, or a stream cut off."""
    if isinstance(exc, httpx2.ConnectTimeout | httpx2.ConnectError):
        return RemoteError(f"cannot reach {host}: is the server running and the URL right? ({exc})")
    if isinstance(exc, httpx2.ReadTimeout):
        if not started:
            return RemoteError(f"{host} sent nothing within {first_byte_s:g} s; it may be overloaded.")
        return RemoteError(f"{host} stopped sending mid-reply (nothing for {first_byte_s:g} s).")
    if isinstance(exc, httpx2.RemoteProtocolError | httpx2.ReadError):
        if started:
            return RemoteError(f"the connection to {host} dropped mid-reply; what arrived is kept.")
        return RemoteError(f"the connection to {host} dropped before the reply started.")
    return RemoteError(f"talking to {host} failed: {type(exc).__name__}: {exc}")
