"""Lock files of the managed runtime: the exact wheels of one CUDA build of torch.

A lock file is JSON, generated at release time by ``packaging/make_runtime_lock.py`` (which runs
``pip install --dry-run --report`` against the variant's index and reads each wheel's size), and
shipped with the app in ``app/runtime/locks/``. It pins the Python ABI and the glibc baseline of
the bundle, so whatever it lists can be unpacked next to the bundle's own modules.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_FORMAT = 1
LOCKS_DIR = Path(__file__).resolve().parent / "locks"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"\d+\.\d+")


class LockError(ValueError):
    """A lock file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class LockedWheel:
    """One archive of the runtime: a wheel, or a zip of prebuilt extension binaries. Both are zip
    files unpacked into the runtime's ``site-packages``."""

    name: str
    version: str
    filename: str
    url: str
    size: int  # bytes to download
    sha256: str
    unpacked_size: int | None = None  # bytes once unpacked (None: not measured; estimated)


@dataclass(frozen=True)
class RuntimeLock:
    variant: str  # cu126, cu128, cu130
    torch: str  # torch's version without the local suffix, e.g. 2.13.0
    cuda: str  # the CUDA version torch was built with, e.g. 13.0
    min_driver_cuda: str  # the driver must support at least this CUDA version (nvidia-smi)
    python: str  # CPython ABI tag the wheels were resolved for, e.g. cp311
    platform: str  # e.g. manylinux_2_28_x86_64
    wheels: tuple[LockedWheel, ...]
    source: str = ""  # where the lock came from (the index), for the record

    @property
    def name(self) -> str:
        """The runtime's folder name under ``<data dir>/runtime/``."""
        return f"torch-{self.torch}-{self.variant}"

    @property
    def download_size(self) -> int:
        return sum(w.size for w in self.wheels)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LOCK_FORMAT,
            "variant": self.variant,
            "torch": self.torch,
            "cuda": self.cuda,
            "min_driver_cuda": self.min_driver_cuda,
            "python": self.python,
            "platform": self.platform,
            "source": self.source,
            "wheels": [
                {
                    "name": w.name,
                    "version": w.version,
                    "filename": w.filename,
                    "url": w.url,
                    "size": w.size,
                    "sha256": w.sha256,
                    "unpacked_size": w.unpacked_size,
                }
                for w in self.wheels
            ],
        }


def parse_lock(data: dict[str, Any], origin: str = "lock file") -> RuntimeLock:
    """A :class:`RuntimeLock` from its JSON; :class:`LockError` naming the bad field otherwise."""

    def need(d: dict[str, Any], key: str, kind: type, where: str) -> Any:
        value = d.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise LockError(f"{origin}: {where}'{key}' is missing or not a {kind.__name__}")
        return value

    if data.get("format") != LOCK_FORMAT:
        raise LockError(f"{origin}: format {data.get('format')!r} is not {LOCK_FORMAT}")
    wheels = []
    seen: set[str] = set()
    for i, w in enumerate(need(data, "wheels", list, "")):
        where = f"wheels[{i}]."
        if not isinstance(w, dict):
            raise LockError(f"{origin}: wheels[{i}] is not an object")
        filename = need(w, "filename", str, where)
        if "/" in filename or "\\" in filename or filename.startswith(".") or filename in seen:
            raise LockError(f"{origin}: {where}filename {filename!r} is not a plain, unique file name")
        seen.add(filename)
        sha = need(w, "sha256", str, where).lower()
        if not _SHA256.fullmatch(sha):
            raise LockError(f"{origin}: {where}sha256 is not 64 hex digits")
        size = need(w, "size", int, where)
        unpacked = w.get("unpacked_size")
        if size <= 0 or (unpacked is not None and (not isinstance(unpacked, int) or unpacked < 0)):
            raise LockError(f"{origin}: {where}size/unpacked_size must be positive integers")
        url = need(w, "url", str, where)
        if not url.startswith(("https://", "http://")):
            raise LockError(f"{origin}: {where}url {url!r} is not an http(s) URL")
        wheels.append(
            LockedWheel(
                need(w, "name", str, where),
                need(w, "version", str, where),
                filename,
                url,
                size,
                sha,
                unpacked,
            )
        )
    if not wheels:
        raise LockError(f"{origin}: lists no wheels")
    for key in ("cuda", "min_driver_cuda"):
        if not _VERSION.match(need(data, key, str, "")):
            raise LockError(f"{origin}: '{key}' is not a version like 12.8")
    return RuntimeLock(
        variant=need(data, "variant", str, ""),
        torch=need(data, "torch", str, ""),
        cuda=data["cuda"],
        min_driver_cuda=data["min_driver_cuda"],
        python=need(data, "python", str, ""),
        platform=need(data, "platform", str, ""),
        wheels=tuple(wheels),
        source=str(data.get("source", "")),
    )


def read_lock(path: Path) -> RuntimeLock:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LockError(f"{path}: cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise LockError(f"{path}: is not a JSON object")
    return parse_lock(data, str(path))


def shipped_locks(folder: Path = LOCKS_DIR) -> list[RuntimeLock]:
    """The lock files that came with the app (``runtime-*.lock.json``), newest CUDA first."""
    locks = [read_lock(p) for p in sorted(Path(folder).glob("runtime-*.lock.json"))]
    return sorted(locks, key=lambda lock: version_key(lock.cuda), reverse=True)


def version_key(version: str) -> tuple[int, ...]:
    """``"12.8"`` -> ``(12, 8)``; non-numeric parts end the key."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)
