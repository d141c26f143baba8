"""A static file server for the GPU-runtime tests (``http.server`` in a thread on 127.0.0.1),
plus small fake wheels and a lock file listing them.

Files are served from memory with ``Range`` support (206). Faults, per file name: ``drop_after``
closes the connection after that many bytes of the next response (once), ``corrupt`` serves
bytes other than the ones the lock's SHA-256 was computed from. ``requests`` records
``(path, Range header)`` of every GET.
"""

from __future__ import annotations

import hashlib
import io
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from app.runtime.lock import LockedWheel, RuntimeLock


class WheelServer:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = dict(files)
        self.drop_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                name = self.path.rsplit("/", 1)[-1]
                server.requests.append((name, self.headers.get("Range")))
                body = server.files.get(name)
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if name in server.corrupt:
                    body = bytes(b ^ 0xFF for b in body)
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                cut = server.drop_after.pop(name, None)
                payload = body[start:] if cut is None else body[start : start + cut]
                self.wfile.write(payload)
                self.wfile.flush()
                if cut is not None:
                    self.close_connection = True
                    self.connection.shutdown(2)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> WheelServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fake_wheel(name: str, files: dict[str, bytes], executable: tuple[str, ...] = ()) -> bytes:
    """A zip laid out like a wheel; ``executable`` entries get mode 0755."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            info = zipfile.ZipInfo(path)
            info.external_attr = (0o755 if path in executable else 0o644) << 16
            zf.writestr(info, data)
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n")
    return buf.getvalue()


BIG_WHEEL = "nvidia_fake_cu13-1.0-py3-none-manylinux_2_27_x86_64.whl"


def fake_runtime_wheels() -> dict[str, bytes]:
    """A torch that is not torch (an ``__init__`` that says so) and a CUDA library wheel big
    enough that a dropped connection lands in its middle."""
    return {
        "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl": fake_wheel(
            "torch",
            {
                "torch/__init__.py": b"__version__ = '2.13.0+fake'\n",
                "torch-2.13.0.data/purelib/torch/extra.py": b"X = 1\n",
                "torch-2.13.0.data/scripts/torchrun": b"#!/bin/sh\n",
            },
        ),
        BIG_WHEEL: fake_wheel(
            "nvidia_fake_cu13",
            {"nvidia/fake/lib/libfake.so": bytes(range(256)) * 2048, "nvidia/fake/bin/tool": b"#!/bin/sh\n"},
            executable=("nvidia/fake/bin/tool",),
        ),
    }


def lock_for(
    files: dict[str, bytes],
    base_url: str,
    *,
    variant: str = "cu130",
    cuda: str = "13.0",
    python: str = "cp311",
    unpacked_factor: int = 2,
) -> RuntimeLock:
    wheels = tuple(
        LockedWheel(
            name=filename.split("-")[0],
            version="1.0",
            filename=filename,
            url=f"{base_url}/files/{filename}",
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            unpacked_size=len(data) * unpacked_factor,
        )
        for filename, data in files.items()
    )
    return RuntimeLock(variant, "2.13.0", cuda, cuda, python, "manylinux_2_28_x86_64", wheels, base_url)


def write_lock(lock: RuntimeLock, folder: Path) -> Path:
    import json

    path = Path(folder) / f"runtime-{lock.variant}.lock.json"
    path.write_text(json.dumps(lock.to_json(), indent=2))
    return path
