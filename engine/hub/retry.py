"""Which failures are worth retrying, and how long to wait before the next try."""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx2
from huggingface_hub import errors as hf_errors

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``base * 2**(attempt-1)``, capped, with +-``jitter`` spread.

    A server's ``Retry-After`` wins over the computed delay (capped at ``max_retry_after`` so a
    misbehaving mirror cannot park a download for hours). ``max_attempts`` counts consecutive
    failures: a download that makes progress between failures resets the count, so a slow flaky
    link still finishes.
    """

    max_attempts: int = 8
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: float = 0.2
    max_retry_after: float = 300.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return max(0.0, min(float(retry_after), self.max_retry_after))
        d = min(self.max_delay, self.base_delay * (2 ** max(0, attempt - 1)))
        return d * (1.0 + random.uniform(-self.jitter, self.jitter))


def status_of(exc: BaseException) -> int | None:
    if isinstance(exc, hf_errors.HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code
    if isinstance(exc, httpx2.HTTPStatusError):
        return exc.response.status_code
    return getattr(exc, "status", None)


def is_retryable(exc: BaseException) -> bool:
    """Network trouble and server-side errors; never 401/403/404 (retrying cannot fix those)."""
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return False
    if isinstance(exc, httpx2.TransportError):  # connect/read errors, timeouts, dropped connections
        return True
    status = status_of(exc)
    return status is not None and status in RETRYABLE_STATUS


def retry_after_seconds(exc: BaseException) -> float | None:
    """The ``Retry-After`` (seconds form) of a 429/503 answer, if the server sent one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    return parse_retry_after(headers.get("Retry-After") if headers is not None else None)


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return None  # HTTP-date form: fall back to our own backoff
