#!/usr/bin/env python3
"""Write the lock file of one GPU-runtime variant: app/runtime/locks/runtime-<variant>.lock.json.

Run at release time, once per variant, on a machine that reaches the variant's package index:

    python packaging/make_runtime_lock.py --variant cu130            # torch from pypi.org
    python packaging/make_runtime_lock.py --variant cu128            # download.pytorch.org/whl/cu128
    python packaging/make_runtime_lock.py --variant cu126

It resolves ``torch==<version>`` (plus its dependencies) for the bundle's Python and glibc
baseline with ``pip install --dry-run --report`` (nothing is installed or downloaded), takes each
wheel's URL and SHA-256 from pip's report, its size from a HEAD request, and its unpacked size from
the zip's central directory (two or three HTTP Range reads per wheel, not the whole wheel). A
prebuilt extension archive (``packaging/build_prebuilt_ext.py --zip``) is added with
``--extension FILE --extension-url URL``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.runtime.lock import LockedWheel, RuntimeLock, parse_lock  # noqa: E402  (after the path entry)

# variant -> (index, requirement suffix, CUDA version, newest CUDA the driver must support)
VARIANTS = {
    "cu130": ("https://pypi.org/simple", "", "13.0"),
    "cu128": ("https://download.pytorch.org/whl/cu128", "+cu128", "12.8"),
    "cu126": ("https://download.pytorch.org/whl/cu126", "+cu126", "12.6"),
}


def platform_tags(glibc: str, arch: str = "x86_64") -> list[str]:
    """Every manylinux tag a glibc ``glibc`` machine accepts: pip takes ``--platform`` literally,
    and the CUDA wheels are tagged anywhere from manylinux1 to manylinux_2_28."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}", f"linux_{arch}"]


def resolve(requirement: str, index: str, python: str, glibc: str, extra_pip: list[str]) -> list[dict]:
    """pip's installation report for ``requirement``: the ``install`` entries."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
            "--quiet", "--target", str(Path(tmp) / "target"), "--report", str(report),
            "--python-version", python, "--only-binary=:all:", "--index-url", index,
            *(arg for tag in platform_tags(glibc) for arg in ("--platform", tag)),
            *extra_pip, requirement,
        ]  # fmt: skip
        subprocess.run(command, check=True)
        return json.loads(report.read_text())["install"]


class RangeReader(io.RawIOBase):
    """A remote file read with HTTP Range requests, enough for ``zipfile`` to list its members."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        if self.pos >= self.size:
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def remote_size(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
        return int(r.headers["Content-Length"])


def unpacked_size(url: str, size: int) -> int:
    with zipfile.ZipFile(io.BufferedReader(RangeReader(url, size), buffer_size=1 << 20)) as zf:
        return sum(info.file_size for info in zf.infolist())


def wheel_from_report(entry: dict) -> LockedWheel:
    info = entry["download_info"]
    url = info["url"]
    sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
    if sha is None or not url.startswith("https://"):
        raise SystemExit(f"{url}: pip's report gives no https URL with a sha256; check the index")
    size = remote_size(url)
    return LockedWheel(
        name=entry["metadata"]["name"],
        version=entry["metadata"]["version"],
        filename=url.rsplit("/", 1)[-1].split("#")[0].replace("%2B", "+"),
        url=url,
        size=size,
        sha256=sha,
        unpacked_size=unpacked_size(url, size),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    p.add_argument("--torch", default="2.13.0", help="torch version (default 2.13.0, the bundle's)")
    p.add_argument("--python", default="3.11", help="the bundle's Python (default 3.11)")
    p.add_argument("--glibc", default="2.28", help="oldest glibc the runtime must run on (default 2.28)")
    p.add_argument("--index-url", help="override the variant's index (a mirror)")
    p.add_argument("--pip-arg", action="append", default=[], help="extra pip argument (e.g. --cert=FILE)")
    p.add_argument("--extension", type=Path, help="zip of prebuilt extension binaries to add")
    p.add_argument("--extension-url", help="where that zip will be published")
    p.add_argument("--out", type=Path, help="default: app/runtime/locks/runtime-<variant>.lock.json")
    args = p.parse_args(argv)
    index, suffix, cuda = VARIANTS[args.variant]
    entries = resolve(
        f"torch=={args.torch}{suffix}", args.index_url or index, args.python, args.glibc, args.pip_arg
    )
    wheels = []
    for entry in entries:
        wheels.append(wheel_from_report(entry))
        print(f"  {wheels[-1].filename}: {wheels[-1].size / 2**20:,.0f} MiB", file=sys.stderr)
    if args.extension:
        if not args.extension_url:
            p.error("--extension needs --extension-url")
        data = args.extension.read_bytes()
        with zipfile.ZipFile(args.extension) as zf:
            unpacked = sum(i.file_size for i in zf.infolist())
        wheels.append(
            LockedWheel("trellis-ext", args.torch, args.extension.name, args.extension_url, len(data),
                        hashlib.sha256(data).hexdigest(), unpacked)
        )  # fmt: skip
    lock = RuntimeLock(
        variant=args.variant,
        torch=args.torch,
        cuda=cuda,
        min_driver_cuda=cuda,
        python="cp" + args.python.replace(".", ""),
        platform=f"manylinux_{args.glibc.replace('.', '_')}_x86_64",
        wheels=tuple(wheels),
        source=index,
    )
    parse_lock(lock.to_json(), "the new lock")  # the app reads it with the same checks
    out = args.out or ROOT / "app" / "runtime" / "locks" / f"runtime-{args.variant}.lock.json"
    out.write_text(json.dumps(lock.to_json(), indent=1) + "\n")
    print(f"{out}: {len(wheels)} files, {lock.download_size / 2**20:,.0f} MiB to download, "
          f"{sum(w.unpacked_size or 0 for w in wheels) / 2**20:,.0f} MiB unpacked")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
