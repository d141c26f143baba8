"""Talking to the Hub's API through ``huggingface_hub``: search, model pages, branches, file plans.

Everything here is a thin layer over ``HfApi``; what it adds is (1) the endpoint and token read at
*call* time, (2) retries for the metadata calls ``huggingface_hub`` does not retry, (3) errors turned
into messages a user can act on, and (4) plain dataclasses the CLI and the GUI can show.

Endpoint: ``huggingface_hub.constants.ENDPOINT`` is read from ``HF_ENDPOINT`` once, when
``huggingface_hub`` is imported. ``HubClient`` instead reads ``HF_ENDPOINT`` whenever it builds a
request (unless given ``endpoint=``) and passes it explicitly (``HfApi(endpoint=...)``,
``hf_hub_url(endpoint=...)``), so a mirror set after import (a setting, a test) is honoured.

Retries: ``HfApi.list_models`` goes through ``http_backoff`` (retries 408/429/5xx and network errors,
sleeping without a way to cancel), but ``model_info`` and ``list_repo_refs`` call the session once.
``_with_retries`` gives those the same retry policy as file downloads.

Offline: before a call, and before retrying a network error, one TCP connect with a short timeout
(``engine.hub.reachability``) checks that the Hub can be reached at all; when it cannot,
``HubOfflineError`` says so at once, instead of after our retries wrapped around huggingface_hub's
(minutes, and a logged warning per attempt).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeVar

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from engine.hub.auth import Secret, resolve_token
from engine.hub.errors import (
    GatedRepoError,
    HubConnectionError,
    HubError,
    HubOfflineError,
    RepoNotFoundError,
    RevisionNotFoundError,
)
from engine.hub.reachability import PROBE_TIMEOUT, unreachable_reason
from engine.hub.retry import RetryPolicy, is_retryable, retry_after_seconds
from engine.supported import is_supported
from engine.units import format_count

T = TypeVar("T")

LIBRARY_NAME = "trellis-chat"
# Metadata requests: connect fast, and never wait forever for a stalled answer (the shared
# huggingface_hub client has no timeout at all).
METADATA_TIMEOUT = 30.0

SortKey = Literal["downloads", "likes", "updated", "created", "trending"]
_SORT_TO_HF = {
    "downloads": "downloads",
    "likes": "likes",
    "updated": "last_modified",
    "created": "created_at",
    "trending": "trending_score",
}

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def current_endpoint(explicit: str | None = None) -> str:
    """The Hub endpoint: explicit, else ``HF_ENDPOINT`` now, else huggingface_hub's default."""
    value = explicit or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    return value.rstrip("/")


_NAME_PARAMS = re.compile(r"(?<![0-9.])([0-9]+(?:\.[0-9]+)?)[bB](?![a-zA-Z])")


def params_from_name(repo_id: str) -> float | None:
    """Parameter count guessed from a name like ``Llama-3.1-8B-Instruct`` (EXL3 repos rarely list one)."""
    m = _NAME_PARAMS.search(repo_id.split("/")[-1])
    return float(m.group(1)) * 1e9 if m else None


@dataclass(frozen=True)
class SearchQuery:
    text: str = ""
    exl3: bool = False
    supported_only: bool = False
    min_params: float | None = None
    max_params: float | None = None
    sort: SortKey = "downloads"
    limit: int = 50


@dataclass(frozen=True)
class ModelSummary:
    """One search hit."""

    repo_id: str
    downloads: int = 0
    likes: int = 0
    last_modified: datetime | None = None
    created_at: datetime | None = None
    tags: tuple[str, ...] = ()
    library: str | None = None
    pipeline_tag: str | None = None
    gated: bool | str = False
    architectures: tuple[str, ...] = ()
    params: float | None = None

    @property
    def exl3(self) -> bool:
        return "exl3" in self.tags or (self.library or "").lower() in ("exl3", "exllamav3")

    @property
    def supported(self) -> bool:
        return is_supported(self.architectures)

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "downloads": self.downloads,
            "likes": self.likes,
            "last_modified": self.last_modified.isoformat() if self.last_modified else None,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "library": self.library,
            "pipeline_tag": self.pipeline_tag,
            "gated": self.gated,
            "architectures": list(self.architectures),
            "params": self.params,
            "exl3": self.exl3,
            "supported": self.supported,
            "tags": list(self.tags),
        }


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo at a commit, with what is needed to verify it."""

    path: str
    size: int
    sha256: str | None = None  # LFS files: the Hub's sha256 of the content
    blob_id: str | None = None  # every file: git blob sha1 (verifies non-LFS files)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "blob_id": self.blob_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RepoFile:
        return cls(path=d["path"], size=int(d["size"]), sha256=d.get("sha256"), blob_id=d.get("blob_id"))


@dataclass(frozen=True)
class Branch:
    name: str
    commit: str


@dataclass(frozen=True)
class ModelDetails:
    """What the model page shows for one repo at one revision."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[RepoFile, ...]
    gated: bool | str = False
    private: bool = False
    license: str | None = None
    tags: tuple[str, ...] = ()
    library: str | None = None
    downloads: int = 0
    likes: int = 0
    last_modified: datetime | None = None
    config: dict[str, Any] | None = None
    params: float | None = None
    branches: tuple[Branch, ...] = field(default=())

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weights_size(self) -> int:
        return sum(f.size for f in self.files if f.path.endswith(WEIGHT_SUFFIXES))


class HubClient:
    """Hub API access with the endpoint and token resolved per call. Thread-safe (no mutable state)."""

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | Secret | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = METADATA_TIMEOUT,
        probe_timeout: float = PROBE_TIMEOUT,
    ) -> None:
        self._endpoint = endpoint
        self._token = token if token is None or isinstance(token, Secret) else Secret(token)
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self.probe_timeout = probe_timeout

    def __repr__(self) -> str:  # never shows the token
        return f"HubClient(endpoint={self.endpoint!r}, token={'set' if self.token() else 'none'})"

    @property
    def endpoint(self) -> str:
        return current_endpoint(self._endpoint)

    def token(self) -> Secret | None:
        return resolve_token(self._token)

    def _api(self) -> HfApi:
        tok = self.token()
        # token=False stops huggingface_hub from picking up a token of its own choosing.
        return HfApi(endpoint=self.endpoint, token=tok.reveal() if tok else False, library_name=LIBRARY_NAME)

    def headers(self) -> dict[str, str]:
        """Request headers (user agent, Authorization when a token exists) for file transfers."""
        tok = self.token()
        return build_hf_headers(token=tok.reveal() if tok else False, library_name=LIBRARY_NAME)

    def file_url(self, repo_id: str, path: str, revision: str) -> str:
        return hf_hub_url(repo_id, path, revision=revision, endpoint=self.endpoint)

    # -- search ---------------------------------------------------------------------------------

    def search(self, query: SearchQuery) -> list[ModelSummary]:
        """Search models. Text, EXL3, parameter range and sort go to the Hub; the architecture filter
        is applied here from each hit's config (the Hub has no such filter)."""
        num_parameters = None
        if query.min_params is not None or query.max_params is not None:
            parts = []
            if query.min_params is not None:
                # the Hub reads the same K/M/B suffixes; a zero bound is "0", not unknown
                parts.append(f"min:{format_count(query.min_params, unknown='0')}")
            if query.max_params is not None:
                parts.append(f"max:{format_count(query.max_params, unknown='0')}")
            num_parameters = ",".join(parts)
        # Over-fetch when filtering locally so a page still has `limit` hits.
        fetch = query.limit * 4 if query.supported_only else query.limit
        api = self._api()

        def call() -> list[ModelSummary]:
            infos = api.list_models(
                search=query.text or None,
                filter=["exl3"] if query.exl3 else None,
                num_parameters=num_parameters,
                sort=_SORT_TO_HF[query.sort],
                limit=fetch,
                expand=[
                    "downloads",
                    "likes",
                    "lastModified",
                    "createdAt",
                    "tags",
                    "library_name",
                    "pipeline_tag",
                    "gated",
                    "config",
                    "safetensors",
                ],
            )
            return [_summary(i) for i in infos]

        hits = self._with_retries(call, repo_id=None)
        if query.supported_only:
            hits = [h for h in hits if h.supported]
        return hits[: query.limit]

    # -- one repo -------------------------------------------------------------------------------

    def branches(self, repo_id: str) -> list[Branch]:
        """Branches of a repo, ``main`` first (EXL3 repos keep one bitrate per branch)."""
        refs = self._with_retries(lambda: self._api().list_repo_refs(repo_id), repo_id=repo_id)
        out = [Branch(b.name, b.target_commit) for b in refs.branches]
        return sorted(out, key=lambda b: (b.name != "main", _natural_key(b.name)))

    def model_details(self, repo_id: str, revision: str = "main", with_branches: bool = True) -> ModelDetails:
        """Model info with per-file sizes and hashes at ``revision`` (pinned to its commit)."""
        api = self._api()
        info = self._with_retries(
            lambda: api.model_info(repo_id, revision=revision, files_metadata=True, timeout=self.timeout),
            repo_id=repo_id,
            revision=revision,
        )
        files = []
        for s in info.siblings or []:
            size = s.lfs.size if s.lfs else s.size
            files.append(
                RepoFile(
                    path=s.rfilename,
                    size=int(size or 0),
                    sha256=s.lfs.sha256 if s.lfs else None,
                    blob_id=s.blob_id,
                )
            )
        card = info.card_data
        license_ = getattr(card, "license", None) if card is not None else None
        if not license_:
            license_ = next((t.split(":", 1)[1] for t in info.tags or [] if t.startswith("license:")), None)
        branches: tuple[Branch, ...] = ()
        if with_branches:
            branches = tuple(self.branches(repo_id))
        params = float(info.safetensors.total) if info.safetensors else params_from_name(repo_id)
        return ModelDetails(
            repo_id=info.id,
            revision=revision,
            commit=info.sha or revision,
            files=tuple(sorted(files, key=lambda f: f.path)),
            gated=info.gated or False,
            private=bool(info.private),
            license=license_,
            tags=tuple(info.tags or ()),
            library=info.library_name,
            downloads=info.downloads or 0,
            likes=info.likes or 0,
            last_modified=info.last_modified,
            config=info.config if isinstance(info.config, dict) else None,
            params=params,
            branches=branches,
        )

    def fetch_text(
        self, repo_id: str, path: str, revision: str = "main", max_bytes: int = 2_000_000
    ) -> str | None:
        """A small text file of the repo (model card, config.json), or None when the repo has none."""

        def call() -> str | None:
            url = self.file_url(repo_id, path, revision)
            r = get_session().get(url, headers=self.headers(), timeout=self.timeout, follow_redirects=True)
            if r.status_code == 404 and r.headers.get("X-Error-Code") == "EntryNotFound":
                return None
            hf_raise_for_status(r)
            return r.content[:max_bytes].decode("utf-8", errors="replace")

        return self._with_retries(call, repo_id=repo_id, revision=revision)

    def model_card(self, repo_id: str, revision: str = "main") -> str:
        """README.md as Markdown, YAML front matter removed ('' when the repo has no card)."""
        text = self.fetch_text(repo_id, "README.md", revision) or ""
        return strip_front_matter(text)

    def config(self, repo_id: str, revision: str = "main") -> dict[str, Any] | None:
        """config.json of the revision (layers, heads... for the memory estimate)."""
        import json

        text = self.fetch_text(repo_id, "config.json", revision)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    # -- errors and retries ---------------------------------------------------------------------

    def check_reachable(self, fresh: bool = False) -> None:
        """Raise HubOfflineError when not even a connection to the endpoint opens."""
        endpoint = self.endpoint
        reason = unreachable_reason(endpoint, self.probe_timeout, fresh=fresh)
        if reason is not None:
            raise HubOfflineError(
                f"No network: cannot reach {endpoint} ({reason}). Check the internet connection "
                "(or HF_ENDPOINT), then try again."
            )

    def _with_retries(
        self,
        call: Callable[[], T],
        repo_id: str | None,
        revision: str | None = None,
        sleep: Callable[[float], bool] | None = None,
    ) -> T:
        """Run a metadata call, retrying network errors, 5xx and 429 with backoff; no network
        at all raises HubOfflineError within seconds."""
        import time

        self.check_reachable()
        attempt = 0
        while True:
            try:
                return call()
            except Exception as exc:
                if not is_retryable(exc) or attempt >= self.retry.max_attempts:
                    raise translate_error(
                        exc, repo_id, revision, self.token() is not None, self.endpoint
                    ) from exc
                if isinstance(exc, httpx2.TransportError):
                    self.check_reachable(fresh=True)  # the network went away: say so, now
                attempt += 1
                delay = self.retry.delay(attempt, retry_after_seconds(exc))
                if sleep is not None:
                    if not sleep(delay):
                        raise
                else:
                    time.sleep(delay)


def _natural_key(name: str) -> list[Any]:
    return [float(p) if p.replace(".", "", 1).isdigit() else p for p in re.split(r"(\d+(?:\.\d+)?)", name)]


def strip_front_matter(text: str) -> str:
    if text.startswith("---"):
        end = text.find("\n---", 3)
        if end != -1:
            nl = text.find("\n", end + 4)
            return text[nl + 1 :] if nl != -1 else ""
    return text


def _summary(info: Any) -> ModelSummary:
    cfg = info.config if isinstance(info.config, dict) else {}
    params = float(info.safetensors.total) if info.safetensors else params_from_name(info.id)
    return ModelSummary(
        repo_id=info.id,
        downloads=info.downloads or 0,
        likes=info.likes or 0,
        last_modified=info.last_modified,
        created_at=info.created_at,
        tags=tuple(info.tags or ()),
        library=info.library_name,
        pipeline_tag=info.pipeline_tag,
        gated=info.gated or False,
        architectures=tuple(cfg.get("architectures") or ()),
        params=params,
    )


def translate_error(
    exc: BaseException, repo_id: str | None, revision: str | None, has_token: bool, endpoint: str
) -> HubError:
    """Turn a huggingface_hub / httpx error into a message that says what happened and what to do."""
    repo = repo_id or "the Hub"
    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, hf_errors.GatedRepoError):
        page = f"{endpoint}/{repo_id}"
        if has_token:
            return GatedRepoError(
                f"{repo} is gated and your token does not have access: accept its terms at {page} "
                "with the account the token belongs to."
            )
        return GatedRepoError(
            f"{repo} is gated: accept its terms at {page}, then set a Hugging Face token "
            "(HF_TOKEN, or save one in the app's settings)."
        )
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return RevisionNotFoundError(f"revision {revision!r} not found in {repo}")
    if isinstance(exc, hf_errors.RemoteEntryNotFoundError):
        return HubError(f"a file is missing from {repo}@{revision}: {_first_line(exc)}")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        hint = "" if has_token else " (if it is private, set a token that has access)"
        return RepoNotFoundError(f"repository {repo} not found on {endpoint}{hint}")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return HubError(f"{endpoint} answered HTTP {status} for {repo}: {_first_line(exc)}")
    if isinstance(exc, httpx2.TransportError | OSError):
        return HubConnectionError(f"cannot reach {endpoint}: {type(exc).__name__}: {exc}")
    return HubError(f"{type(exc).__name__}: {exc}")


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def iter_weight_files(files: Iterable[RepoFile]) -> Iterable[RepoFile]:
    return (f for f in files if f.path.endswith(WEIGHT_SUFFIXES))
