"""Names of remote models: ``remote:<base URL>#<model id>``, where a local model has its folder.

The base URL is the endpoint's (``http://host:8000/v1``); ``#`` never occurs in one (a URL's
fragment means nothing to a server), so it separates the model id, which may hold ``/``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

PREFIX = "remote:"


def is_remote_ref(text: str) -> bool:
    return str(text).startswith(PREFIX)


def make_ref(base_url: str, model: str) -> str:
    return f"{PREFIX}{normalize_base_url(base_url)}#{model}"


def split_ref(ref: str) -> tuple[str, str]:
    """(base URL, model id) of a reference; ValueError when ``ref`` is not one."""
    if not is_remote_ref(ref) or "#" not in ref:
        raise ValueError(f"not a remote model reference: {ref!r}")
    base, _, model = ref[len(PREFIX) :].partition("#")
    if not base or not model:
        raise ValueError(f"not a remote model reference: {ref!r}")
    return base, model


def normalize_base_url(url: str) -> str:
    """The base URL as given, checked: http(s), a host, no trailing slash; ValueError otherwise.
    A URL without a path gets ``/v1`` (what every OpenAI-compatible server serves under)."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    if "#" in url:
        raise ValueError(f"{url!r} has a fragment (#...), which a base URL cannot have")
    if parts.path in ("", "/"):
        url += "/v1"
    return url


def host_of(base_url: str) -> str:
    return urlsplit(base_url).netloc
