"""A local Hugging Face Hub look-alike on 127.0.0.1, for tests and measurements (no internet needed).

Test support, not engine code: it lives under ``tests/support/`` (on ``sys.path`` through
``tests/conftest.py``; import it as ``fake_hub``), so the library ships no fake server.

It speaks the part of the Hub's HTTP API that ``huggingface_hub`` uses for browsing and
downloading models: ``/api/models`` (search with ``search``, ``filter``, ``num_parameters``, ``sort``,
``limit``, ``expand``), ``/api/models/<repo>[/revision/<rev>]`` (with ``blobs=true`` file sizes, git
blob ids and LFS sha256), ``/api/models/<repo>/refs``, ``/api/models/<repo>/tree/<rev>``,
``/api/models/<repo>/paths-info/<rev>``, and ``/<repo>/resolve/<rev>/<path>`` (HEAD and GET; LFS files
redirect to a ``/cdn-lfs/`` URL like the real Hub's CDN; ``Range`` requests answer 206; ``ETag``,
``X-Repo-Commit``, ``X-Linked-Etag``, ``X-Linked-Size`` headers; error codes in ``X-Error-Code``).

Gated repos answer 401 (no token) or 403 (token without access) with ``X-Error-Code: GatedRepo``;
private repos answer 401 ``RepoNotFound``. Faults can be injected per file: an HTTP status (with
``Retry-After``), a connection dropped after N bytes, a stall, ignoring ``Range``, corrupted bytes,
throttled bandwidth.

Large files are generated, not stored: ``PatternBlob`` makes deterministic content of any size from
a seed, so a 1 GB model costs no memory on the server side either.

Run standalone (to measure download speed against a local server)::

    python tests/support/fake_hub.py --size-mb 1024 --files 4 [--port 8765]
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

BLOCK = 1 << 20
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


class Blob:
    """File content: its size, bytes at an offset, sha256 and git blob sha1."""

    size: int

    def read(self, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def chunks(self, start: int = 0, end: int | None = None, step: int = BLOCK):
        end = self.size if end is None else end
        pos = start
        while pos < end:
            n = min(step, end - pos)
            yield self.read(pos, n)
            pos += n

    def _digests(self) -> tuple[str, str]:
        cached = getattr(self, "_cached_digests", None)
        if cached is None:
            s256 = hashlib.sha256()
            s1 = hashlib.sha1(f"blob {self.size}\0".encode())
            for c in self.chunks(step=8 * BLOCK):
                s256.update(c)
                s1.update(c)
            cached = (s256.hexdigest(), s1.hexdigest())
            self._cached_digests = cached
        return cached

    @property
    def sha256(self) -> str:
        return self._digests()[0]

    @property
    def git_sha1(self) -> str:
        return self._digests()[1]


class BytesBlob(Blob):
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]


class PatternBlob(Blob):
    """``size`` bytes of deterministic pseudo-random content; every 1 MiB block differs, so a
    resume at a wrong offset cannot produce the right hash by accident."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.seed = seed
        self._base = random.Random(seed).randbytes(BLOCK)

    def _block(self, k: int) -> bytes:
        r = (k * 7919 + self.seed) % BLOCK
        return self._base[r:] + self._base[:r]

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray()
        end = min(self.size, offset + length)
        pos = offset
        while pos < end:
            k, inner = divmod(pos, BLOCK)
            take = min(BLOCK - inner, end - pos)
            out += self._block(k)[inner : inner + take]
            pos += take
        return bytes(out)


def as_blob(content: bytes | str | Blob) -> Blob:
    if isinstance(content, Blob):
        return content
    if isinstance(content, str):
        content = content.encode()
    return BytesBlob(content)


@dataclass
class FakeRepo:
    repo_id: str
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # sha -> files
    branches: dict[str, str] = field(default_factory=dict)  # name -> sha
    gated: bool | str = False
    private: bool = False
    tokens: set[str] = field(default_factory=set)  # tokens with access (gated or private)
    tags: list[str] = field(default_factory=list)
    library_name: str | None = None
    pipeline_tag: str | None = "text-generation"
    downloads: int = 0
    likes: int = 0
    trending: float = 0.0
    created_at: datetime = field(default_factory=lambda: datetime(2025, 1, 1, tzinfo=UTC))
    last_modified: datetime = field(default_factory=lambda: datetime(2025, 1, 1, tzinfo=UTC))
    card_data: dict[str, Any] | None = None
    params: int | None = None

    def set_branch(self, name: str, files: dict[str, bytes | str | Blob]) -> str:
        """Create a commit with ``files`` and point branch ``name`` at it; returns the commit sha."""
        blobs = {p: as_blob(c) for p, c in files.items()}
        h = hashlib.sha1(f"{self.repo_id}\0{name}\0{len(self.commits)}".encode())
        for p in sorted(blobs):
            h.update(p.encode() + b"\0" + str(blobs[p].size).encode())
        sha = h.hexdigest()
        self.commits[sha] = blobs
        self.branches[name] = sha
        return sha

    def resolve(self, revision: str) -> tuple[str, dict[str, Blob]] | None:
        sha = self.branches.get(revision, revision)
        files = self.commits.get(sha)
        return (sha, files) if files is not None else None

    def config(self, revision: str = "main") -> dict[str, Any] | None:
        resolved = self.resolve(revision)
        if resolved is None or "config.json" not in resolved[1]:
            return None
        blob = resolved[1]["config.json"]
        try:
            return json.loads(blob.read(0, blob.size))
        except ValueError:
            return None


@dataclass
class Fault:
    """One injected failure on GETs of a file's content. ``times=None``: every request."""

    path: str  # fnmatch pattern on the repo path
    kind: str  # status | drop | stall | ignore_range | corrupt | throttle
    repo_id: str | None = None
    times: int | None = 1
    status: int = 500
    retry_after: str | None = None
    after: int = 0  # bytes sent before a drop/stall
    seconds: float = 30.0  # stall length
    at: int = 0  # absolute offset of the byte a corrupt fault flips
    rate: float = 1e6  # bytes/s for throttle
    hits: int = 0

    def matches(self, repo_id: str, path: str) -> bool:
        if self.repo_id is not None and self.repo_id != repo_id:
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        return fnmatch.fnmatch(path, self.path)


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    range: str | None
    authorized: bool
    status: int = 0


class FakeHub:
    """The server. ``with FakeHub() as hub: hub.add_repo(...); HF_ENDPOINT=hub.endpoint``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.repos: dict[str, FakeRepo] = {}
        self.faults: list[Fault] = []
        self.requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- setup ------------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes | str | Blob] | None = None,
        *,
        branches: dict[str, dict[str, bytes | str | Blob]] | None = None,
        **meta: Any,
    ) -> FakeRepo:
        repo = FakeRepo(repo_id=repo_id, **meta)
        if files is not None:
            repo.set_branch("main", files)
        for name, bfiles in (branches or {}).items():
            repo.set_branch(name, bfiles)
        if repo.params is None:
            total = 0
            for blob_path, blob in (repo.resolve("main") or ("", {}))[1].items():
                if blob_path.endswith(".safetensors"):
                    total += blob.size // 2  # "bf16": two bytes per parameter
            repo.params = total or None
        self.repos[repo_id] = repo
        return repo

    def fault(self, path: str, kind: str, **kw: Any) -> Fault:
        f = Fault(path=path, kind=kind, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def requests_for(self, path_fragment: str, method: str = "GET") -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.requests if path_fragment in r.path and r.method == method]

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://{self.host}:{self._server.server_address[1]}"

    @property
    def cdn_endpoint(self) -> str:
        """LFS redirects point here: the same server under another host name, so that clients treat
        it as a separate origin (as the Hub's CDN is): no Authorization header, metadata from the 302."""
        assert self._server is not None, "start() first"
        return f"http://localhost:{self._server.server_address[1]}"

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _take_fault(self, repo_id: str, path: str, kinds: tuple[str, ...]) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.kind in kinds and f.matches(repo_id, path):
                    f.hits += 1
                    return f
        return None


def _iso(d: datetime) -> str:
    return d.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    # -- helpers ----------------------------------------------------------------------------------

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else None

    def _record(self, status: int) -> None:
        with self.fake._lock:
            self.fake.requests.append(
                RequestRecord(
                    self.command, self.path, self.headers.get("Range"), self._token() is not None, status
                )
            )

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self._record(status)
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, data: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json({"error": message}, status, headers)

    def _access(self, repo: FakeRepo, for_files: bool) -> bool:
        """Apply private/gated rules; sends the error and returns False when access is denied."""
        token = self._token()
        if repo.private and token not in repo.tokens:
            self._error(401, "RepoNotFound", "Repository not found")
            return False
        if for_files and repo.gated and token not in repo.tokens:
            if token is None:
                self._error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted. You must be authenticated.",
                )
            else:
                self._error(
                    403,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted and you are not in the authorized list.",
                )
            return False
        return True

    def _repo(self, parts: list[str]) -> FakeRepo | None:
        if len(parts) < 2:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        repo = self.fake.repos.get(f"{parts[0]}/{parts[1]}")
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        return repo

    # -- dispatch ---------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        try:
            if parts[:2] == ["api", "models"] and len(parts) == 2:
                return self._list_models(query)
            if parts[:2] == ["api", "models"]:
                return self._api_repo(parts[2:], query)
            if parts and parts[0] == "cdn-lfs":
                return self._cdn(query)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts)
            self._error(404, None, "Not Found")
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -- API --------------------------------------------------------------------------------------

    def _model_json(self, repo: FakeRepo, revision: str, expand: list[str] | None, blobs: bool) -> dict:
        resolved = repo.resolve(revision)
        sha, files = resolved if resolved else (None, {})
        full: dict[str, Any] = {
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "private": repo.private,
            "gated": repo.gated,
            "disabled": False,
            "downloads": repo.downloads,
            "likes": repo.likes,
            "trendingScore": repo.trending,
            "tags": list(repo.tags),
            "library_name": repo.library_name,
            "pipeline_tag": repo.pipeline_tag,
            "createdAt": _iso(repo.created_at),
            "lastModified": _iso(repo.last_modified),
            "cardData": repo.card_data,
            "config": repo.config(revision),
        }
        if repo.params:
            full["safetensors"] = {"parameters": {"BF16": repo.params}, "total": repo.params}
        siblings = []
        for path in sorted(files):
            entry: dict[str, Any] = {"rfilename": path}
            if blobs:
                blob = files[path]
                entry["size"] = blob.size
                entry["blobId"] = blob.git_sha1
                if path.endswith(LFS_SUFFIXES):
                    entry["blobId"] = hashlib.sha1(blob.sha256.encode()).hexdigest()  # the pointer's id
                    entry["size"] = 134
                    entry["lfs"] = {"size": blob.size, "sha256": blob.sha256, "pointerSize": 134}
            siblings.append(entry)
        full["siblings"] = siblings
        if expand:
            return {"id": repo.repo_id, "_id": repo.repo_id, **{k: full.get(k) for k in expand if k in full}}
        return full

    def _list_models(self, query: dict[str, list[str]]) -> None:
        token = self._token()
        text = (query.get("search") or [""])[0].lower()
        filters = query.get("filter", [])
        repos = [r for r in self.fake.repos.values() if not r.private or token in r.tokens]
        repos = [r for r in repos if text in r.repo_id.lower()]
        for f in filters:
            repos = [r for r in repos if f in r.tags or f == r.library_name]
        if "num_parameters" in query:
            lo, hi = 0.0, float("inf")
            for part in query["num_parameters"][0].split(","):
                key, _, value = part.partition(":")
                n = _parse_count(value)
                if key == "min":
                    lo = n
                elif key == "max":
                    hi = n
            repos = [r for r in repos if r.params is not None and lo <= r.params <= hi]
        sort = (query.get("sort") or [None])[0]
        keys = {
            "downloads": lambda r: r.downloads,
            "likes": lambda r: r.likes,
            "lastModified": lambda r: r.last_modified,
            "createdAt": lambda r: r.created_at,
            "trendingScore": lambda r: r.trending,
        }
        if sort in keys:
            repos.sort(key=keys[sort], reverse=(query.get("direction") or ["-1"])[0] == "-1")
        limit = int((query.get("limit") or ["1000"])[0])
        expand = query.get("expand")
        self._json([self._model_json(r, "main", expand, False) for r in repos[:limit]])

    def _api_repo(self, parts: list[str], query: dict[str, list[str]]) -> None:
        repo = self._repo(parts)
        if repo is None or not self._access(repo, for_files=False):
            return
        rest = parts[2:]
        if not rest or rest[0] == "revision":
            revision = rest[1] if len(rest) > 1 else "main"
            if repo.resolve(revision) is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            blobs = (query.get("blobs") or ["false"])[0].lower() == "true"
            return self._json(self._model_json(repo, revision, query.get("expand"), blobs))
        if rest[0] == "refs":
            return self._json(
                {
                    "branches": [
                        {"name": n, "ref": f"refs/heads/{n}", "targetCommit": sha}
                        for n, sha in repo.branches.items()
                    ],
                    "tags": [],
                    "converts": [],
                }
            )
        if rest[0] in ("tree", "paths-info") and len(rest) >= 2:
            resolved = repo.resolve(rest[1])
            if resolved is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
            _, files = resolved
            if rest[0] == "tree":
                prefix = "/".join(rest[2:])
                wanted = [p for p in sorted(files) if p.startswith(prefix)]
            else:
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode()) if length else {}
                wanted = [p for p in form.get("paths", []) if p in files]
            return self._json([self._tree_entry(p, files[p]) for p in wanted])
        self._error(404, None, "Not Found")

    def _tree_entry(self, path: str, blob: Blob) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": blob.git_sha1, "size": blob.size, "path": path}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": 134}
        return entry

    # -- files ------------------------------------------------------------------------------------

    def _resolve(self, parts: list[str]) -> None:
        repo = self._repo(parts)
        if repo is None or not self._access(repo, for_files=True):
            return
        revision, path = parts[3], "/".join(parts[4:])
        resolved = repo.resolve(revision)
        if resolved is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        sha, files = resolved
        blob = files.get(path)
        if blob is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {revision}")
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if path.endswith(LFS_SUFFIXES):
            location = (
                f"{self.fake.cdn_endpoint}/cdn-lfs/{blob.sha256}?repo={quote(repo.repo_id, safe='')}"
                f"&commit={sha}&path={quote(path, safe='')}"
            )
            headers.update(
                {
                    "Location": location,
                    "ETag": f'"{hashlib.sha1(blob.sha256.encode()).hexdigest()}"',
                    "X-Linked-Etag": f'"{blob.sha256}"',
                    "X-Linked-Size": str(blob.size),
                }
            )
            return self._send(302, b"", headers)
        headers["ETag"] = f'"{blob.git_sha1}"'
        self._serve(repo.repo_id, path, blob, headers)

    def _cdn(self, query: dict[str, list[str]]) -> None:
        repo = self.fake.repos.get(query.get("repo", [""])[0])
        commit, path = query.get("commit", [""])[0], query.get("path", [""])[0]
        blob = repo.commits.get(commit, {}).get(path) if repo else None
        if repo is None or blob is None:
            return self._error(404, None, "Not Found")
        self._serve(repo.repo_id, path, blob, {"ETag": f'"{blob.sha256}"', "Accept-Ranges": "bytes"})

    def _serve(self, repo_id: str, path: str, blob: Blob, headers: dict[str, str]) -> None:
        fake = self.fake
        if self.command == "GET":
            status_fault = fake._take_fault(repo_id, path, ("status",))
            if status_fault is not None:
                extra = {"Retry-After": status_fault.retry_after} if status_fault.retry_after else {}
                return self._json(
                    {"error": f"injected HTTP {status_fault.status}"}, status_fault.status, extra
                )
        start, end = 0, blob.size
        status = 200
        rng = self.headers.get("Range")
        ignore_range = (
            self.command == "GET" and fake._take_fault(repo_id, path, ("ignore_range",)) is not None
        )
        if rng and not ignore_range:
            try:
                spec = rng.split("=", 1)[1].split(",")[0]
                a, _, b = spec.partition("-")
                start = int(a) if a else max(0, blob.size - int(b))
                end = min(blob.size, int(b) + 1) if a and b else blob.size
            except (IndexError, ValueError):
                return self._error(400, None, "bad range")
            if start >= blob.size and blob.size > 0:
                return self._send(416, b"", {"Content-Range": f"bytes */{blob.size}"})
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{blob.size}"}
        self._record(status)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if self.command == "HEAD":
            return
        drop = fake._take_fault(repo_id, path, ("drop",))
        stall = fake._take_fault(repo_id, path, ("stall",))
        corrupt = fake._take_fault(repo_id, path, ("corrupt",))
        throttle = fake._take_fault(repo_id, path, ("throttle",))
        sent = 0
        pos = start
        step = 64 << 10 if throttle else BLOCK
        t0 = time.monotonic()
        while pos < end:
            n = min(step, end - pos)
            if drop is not None and sent + n > drop.after:
                n = drop.after - sent
            if stall is not None and sent + n > stall.after:
                n = stall.after - sent
            if n > 0:
                data = blob.read(pos, n)
                if corrupt is not None and pos <= corrupt.at < pos + n:
                    i = corrupt.at - pos
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                self.wfile.write(data)
                pos += n
                sent += n
            if drop is not None and sent >= drop.after:
                self.wfile.flush()
                self._abort()
                return
            if stall is not None and sent >= stall.after:
                self.wfile.flush()
                fake._stopping.wait(stall.seconds)
                self._abort()
                return
            if throttle is not None:
                ahead = sent / throttle.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)

    def _abort(self) -> None:
        """Close the socket mid-body, as a dropped connection would."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _parse_count(text: str) -> float:
    text = text.strip()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper(), 1.0)
    number = text[:-1] if text[-1:].upper() in "KMBT" else text
    return float(number) * scale


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """A small Llama config.json for fake repos (the memory estimate reads these fields)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "vocab_size": 1000,
    }
    cfg.update(overrides)
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Serve a fake Hub with one generated model (bench/big-model)"
    )
    parser.add_argument("--size-mb", type=int, default=1024, help="total size of the weight shards")
    parser.add_argument("--files", type=int, default=4, help="number of weight shards")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    hub = FakeHub(port=args.port)
    total = args.size_mb << 20
    files: dict[str, bytes | str | Blob] = {
        "config.json": json.dumps(tiny_llama_config()),
        "README.md": "---\nlicense: apache-2.0\n---\n# big model\n",
    }
    for i in range(args.files):
        files[f"model-{i + 1:05d}-of-{args.files:05d}.safetensors"] = PatternBlob(
            total // args.files, seed=i + 1
        )
    hub.add_repo("bench/big-model", files, tags=["safetensors"], downloads=1)
    for blob in hub.repos["bench/big-model"].commits[hub.repos["bench/big-model"].branches["main"]].values():
        _ = blob.sha256  # hash up front so the first request is not slowed by it
    endpoint = hub.start()
    print(endpoint, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
