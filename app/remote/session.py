"""A model on a remote OpenAI-compatible endpoint, behind the engine's ``SessionProtocol``.

The worker drives a :class:`RemoteSession` exactly as it drives a local ``ChatSession``, on its
own thread: ``stream`` yields ``StreamChunk`` s, so the chat, stop, regenerate and the reply's
stats need nothing remote-specific. The HTTP request runs on one more thread of its own (a
*pump* that hands the server's events over through a queue), so the worker's loop wakes every
``POLL_S`` whatever the network does: Stop is honoured at once even while the server is silent,
and the response is closed from here.

Counts: tokens and tok/s come from the stream (its ``usage`` when the server sends it, else one
token per content event); ``count_tokens`` is an estimate (about four characters a token), as
the endpoint has no tokenizer endpoint OpenAI defines.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2

from app.remote.errors import RemoteError, status_error, transport_error
from app.remote.keys import get_key
from app.remote.refs import host_of, split_ref
from app.remote.wire import ToolCallAssembler, request_body, sse_events
from engine.api import ChatMessage, ChunkStream, GenerationRequest, StreamChunk

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
# How long the server may stay silent: before the first byte (a big model reading a long prompt
# takes a while) and between two events.
FIRST_BYTE_TIMEOUT_S = 300.0
POLL_S = 0.05  # how often the worker's loop checks Stop while waiting for the server
LIST_TIMEOUT_S = 10.0
# For the context meter only: the count is an estimate (see the module's docstring).
CHARS_PER_TOKEN = 4
IMAGE_TOKENS_GUESS = 256

_FINISH = {"stop": "eos", "length": "max_new_tokens", "tool_calls": "eos", "function_call": "eos"}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def list_models(base_url: str, api_key: str | None, timeout: float = LIST_TIMEOUT_S) -> list[dict[str, Any]]:
    """The endpoint's ``GET /models`` cards; RemoteError with the reason when it cannot say."""
    host = host_of(base_url)
    try:
        response = httpx2.get(f"{base_url}/models", headers=_headers(api_key), timeout=timeout)
    except httpx2.HTTPError as exc:
        raise transport_error(host, exc, False, timeout) from exc
    if response.status_code >= 400:
        raise status_error(host, response.status_code, response.content, response.headers.get("retry-after"))
    try:
        data = response.json().get("data", [])
    except (ValueError, AttributeError) as exc:
        raise RemoteError(f"{host} answered /models with something that is not OpenAI's list") from exc
    return [card for card in data if isinstance(card, dict) and card.get("id")]


def _context_of(card: dict[str, Any]) -> int:
    """The context a model card states (vLLM: max_model_len; others: context_length); 0 unknown."""
    for key in ("max_model_len", "context_length", "context_window", "max_context_length"):
        value = card.get(key)
        if isinstance(value, int) and value > 0:
            return value
    meta = card.get("meta")
    if isinstance(meta, dict) and isinstance(meta.get("n_ctx_train"), int):
        return meta["n_ctx_train"]  # llama.cpp's server
    return 0


@dataclass
class _Response:
    """The pump's open response, so the worker's thread can close it on Stop."""

    value: httpx2.Response | None = None


_END = object()


class RemoteSession:
    """One model of one endpoint; construct with :meth:`open` (it checks both exist)."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, context_length: int = 0
    ) -> None:
        self.base_url, self.model, self._api_key = base_url, model, api_key
        self.host = host_of(base_url)
        self._context_length = context_length

    def __repr__(self) -> str:  # never the key
        return f"RemoteSession({self.base_url!r}, {self.model!r})"

    @classmethod
    def open(cls, ref: str, progress: Callable[[float, str], None] | None = None) -> RemoteSession:
        """The session of a ``remote:`` reference: its key from the keyring, the endpoint asked
        whether it serves the model (a wrong URL, key or model fails here, at "load")."""
        base_url, model = split_ref(ref)
        if progress is not None:
            progress(0.2, f"Connecting to {host_of(base_url)}")
        api_key = get_key(base_url)
        cards = list_models(base_url, api_key)
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            names = ", ".join(c["id"] for c in cards[:8]) or "none"
            raise RemoteError(f"{host_of(base_url)} does not serve the model {model!r} (it serves: {names})")
        return cls(base_url, model, api_key, _context_of(card))

    # -- SessionProtocol ------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.model

    @property
    def device(self) -> str:
        return f"remote ({self.host})"

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def sees_images(self) -> bool:
        # OpenAI's API cannot say; the endpoint refuses images its model cannot see, and that
        # refusal is shown like any other.
        return True

    @property
    def has_chat_template(self) -> bool:
        return True

    def memory_bytes(self) -> int:
        return 0

    def count_tokens(self, messages: Sequence[ChatMessage], completion: bool = False) -> int:
        chars = images = 0
        for m in messages:
            content = m.get("content", "")
            chars += (
                len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
            )
            images += len(m.get("images") or ())
        return chars // CHARS_PER_TOKEN + 4 * len(messages) + IMAGE_TOKENS_GUESS * images

    def warm_up(self) -> None:
        pass  # nothing to pay for up front: open() already asked the endpoint

    def unload(self) -> None:
        self._api_key = None

    def stream(
        self,
        messages: Sequence[ChatMessage],
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> ChunkStream:
        if request.completion:
            raise RemoteError("remote endpoints are used for chat only (this model has no chat template)")
        body = request_body(self.model, messages, request)
        events: queue.Queue[Any] = queue.Queue()
        stop = threading.Event()
        holder = _Response()
        pump = threading.Thread(
            target=self._pump, args=(body, events, stop, holder), name="remote-stream", daemon=True
        )
        pump.start()
        started = time.perf_counter()
        first_token_at = 0.0
        new_tokens = prompt_tokens = 0
        usage_tokens: int | None = None
        stop_reason: str | None = None
        calls = ToolCallAssembler()
        try:
            while True:
                try:
                    item = events.get(timeout=POLL_S)
                except queue.Empty:
                    if should_stop is not None and should_stop():
                        yield StreamChunk("", [], True, "cancelled", prompt_tokens, new_tokens=new_tokens)
                        return
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item is _END:
                    break
                if item.strip() == "[DONE]":
                    stop_reason = stop_reason or "eos"
                    break
                event = self._parse(item)
                if event.get("error"):
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else str(error)
                    raise RemoteError(f"{self.host} ended the reply with an error: {message}")
                usage = event.get("usage")
                if isinstance(usage, dict):
                    prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
                    usage_tokens = usage.get("completion_tokens")
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if delta.get("tool_calls"):
                        calls.feed(delta["tool_calls"])
                    if choice.get("finish_reason"):
                        stop_reason = _FINISH.get(choice["finish_reason"], choice["finish_reason"])
                    if text or reasoning:
                        if not first_token_at:
                            first_token_at = time.perf_counter()
                        new_tokens += 1
                        yield StreamChunk(
                            text,
                            [],
                            prompt_tokens=prompt_tokens,
                            new_tokens=new_tokens,
                            tokens_per_second=self._speed(new_tokens, first_token_at),
                            reasoning=reasoning,
                        )
            if stop_reason is None:
                raise RemoteError(
                    f"the connection to {self.host} ended before the reply did; what arrived is kept."
                )
            total = int(usage_tokens) if usage_tokens is not None else new_tokens
            elapsed = time.perf_counter() - (first_token_at or started)
            yield StreamChunk(
                "",
                [],
                True,
                stop_reason,
                prompt_tokens,
                new_tokens=total,
                tokens_per_second=(total - 1) / elapsed if total > 1 and elapsed > 0 else 0.0,
                tool_calls=calls.calls(),
            )
        finally:
            stop.set()
            response = holder.value
            if response is not None:
                try:
                    response.close()
                except Exception:  # closing from this thread while the pump reads: best effort
                    pass

    # -- the pump's thread -------------------------------------------------------------------------

    def _pump(
        self, body: dict[str, Any], events: queue.Queue, stop: threading.Event, holder: _Response
    ) -> None:
        timeout = httpx2.Timeout(FIRST_BYTE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        started = False
        try:
            with httpx2.Client(timeout=timeout) as client:
                url = f"{self.base_url}/chat/completions"
                with client.stream("POST", url, json=body, headers=_headers(self._api_key)) as response:
                    holder.value = response
                    if response.status_code >= 400:
                        response.read()
                        retry = response.headers.get("retry-after")
                        events.put(status_error(self.host, response.status_code, response.content, retry))
                        return
                    for data in sse_events(response.iter_lines()):
                        if stop.is_set():
                            return
                        started = True
                        events.put(data)
            events.put(_END)
        except Exception as exc:
            if stop.is_set():
                return  # closed on purpose (Stop): nobody is listening
            log.info("remote stream from %s failed: %s", self.host, type(exc).__name__)
            events.put(transport_error(self.host, exc, started, FIRST_BYTE_TIMEOUT_S))

    def _parse(self, data: str) -> dict[str, Any]:
        try:
            value = json.loads(data)
        except ValueError as exc:
            raise RemoteError(f"{self.host} sent an event that is not JSON: {data[:80]!r}") from exc
        return value if isinstance(value, dict) else {}

    @staticmethod
    def _speed(tokens: int, first_at: float) -> float:
        elapsed = time.perf_counter() - first_at
        return (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else 0.0
