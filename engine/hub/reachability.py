"""Is the Hub reachable at all? One TCP connect with a short timeout answers it in seconds.

Without this, an offline search waits for ``huggingface_hub``'s own retries (five, with backoff)
inside each of ours: minutes of "Loading..." and a warning per attempt. A refused connection, an
unknown host or no route fails the probe at once; a black-holed address after ``timeout``.

Through a proxy (``HTTPS_PROXY`` and friends, as ``httpx`` reads them) the probe connects to the
proxy instead: the endpoint itself may only be reachable through it. A reachable answer is cached
for a little while so that a browsing session does not pay a connect per request.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from urllib.parse import urlsplit

# Long enough for a slow but working link to open a connection; short enough that "no network"
# is said within seconds.
PROBE_TIMEOUT = 4.0
# How long a successful probe is believed.
REACHABLE_FOR = 30.0

_lock = threading.Lock()
_reachable_until: dict[tuple[str, int], float] = {}


def _target(endpoint: str) -> tuple[str, int]:
    """(host, port) the first connection goes to: the proxy for ``endpoint``, if one is set."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    scheme = parts.scheme or "https"
    proxy = urllib.request.getproxies().get(scheme) or urllib.request.getproxies().get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return proxy_parts.hostname or "", proxy_parts.port or 8080
    return host, parts.port or (443 if scheme == "https" else 80)


def _describe(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return "the name could not be resolved"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no answer"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return exc.strerror or type(exc).__name__


def unreachable_reason(endpoint: str, timeout: float = PROBE_TIMEOUT, fresh: bool = False) -> str | None:
    """None when a TCP connection to ``endpoint`` (or its proxy) opens within ``timeout``
    seconds, else why not, in words. ``fresh``: ignore an earlier success."""
    target = _target(endpoint)
    now = time.monotonic()
    if not fresh:
        with _lock:
            if _reachable_until.get(target, 0.0) > now:
                return None
    try:
        with socket.create_connection(target, timeout=timeout):
            pass
    except OSError as exc:
        with _lock:
            _reachable_until.pop(target, None)
        return _describe(exc)
    with _lock:
        _reachable_until[target] = time.monotonic() + REACHABLE_FOR
    return None
