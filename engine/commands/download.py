"""``python -m engine download REPO_ID [--revision R] [--dir D]``: download a model, verified.

Honours ``HF_ENDPOINT`` (mirrors) and ``HF_TOKEN`` (gated/private repos; else the keyring, else
``hf auth login``'s token). Re-running the same command after an interruption (Ctrl-C, kill -9,
reboot) resumes from the bytes already on disk. Exit status 0 only when every file matched the
Hub's hash; failures print ``error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.commands.common import positive_int

# The Hub stack (huggingface_hub, httpx2) is imported when a download runs, not when the CLI
# starts: `python -m engine generate` must work where only the inference dependencies exist.
if TYPE_CHECKING:
    from engine.hub.downloads import JobSnapshot


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "download",
        help="download a model from the Hugging Face Hub (resumable, verified)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("repo_id", help="owner/name on the Hub")
    p.add_argument(
        "--revision", default="main", help="branch, tag or commit (EXL3 bitrates live on branches)"
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="model directory to create (default: the models folder)"
    )
    p.add_argument(
        "--include", action="append", default=None, metavar="GLOB", help="only files matching (repeatable)"
    )
    p.add_argument(
        "--retries",
        type=positive_int,
        default=8,
        help="consecutive failed attempts per file before giving up",
    )
    p.add_argument("--quiet", action="store_true", help="print only the final path")
    p.set_defaults(func=run)


def _line(s: JobSnapshot) -> str:
    from engine.units import format_bytes

    pct = 100.0 * s.fraction
    text = f"{s.state.value:<11} {pct:5.1f}%  {format_bytes(s.done_bytes)} / {format_bytes(s.total_bytes)}"
    if s.speed:
        text += f"  {format_bytes(s.speed)}/s"
    if s.eta is not None:
        text += f"  ETA {int(s.eta) // 60}:{int(s.eta) % 60:02d}"
    if s.note:
        text += f"  [{s.note}]"
    elif s.current_file:
        text += f"  {s.current_file}"
    return text


def run(args: argparse.Namespace) -> int:
    from engine.hub.client import HubClient
    from engine.hub.downloads import DownloadManager, JobState
    from engine.hub.errors import DownloadError
    from engine.hub.library import PARTIAL_DIR, default_models_dir
    from engine.hub.retry import RetryPolicy
    from engine.units import format_bytes

    dest = args.dir if args.dir is not None else None
    manager = DownloadManager(
        default_models_dir(),
        client=HubClient(retry=RetryPolicy(max_attempts=args.retries)),
        state_path=None,
        max_concurrent=1,
        retry=RetryPolicy(max_attempts=args.retries),
    )
    job_id = manager.enqueue(args.repo_id, args.revision, dest=dest, include=args.include)
    tty = sys.stderr.isatty()
    last_print = 0.0
    try:
        while True:
            snap = manager.wait(job_id, timeout=0.5 if tty else 2.0)
            now = time.monotonic()
            if not args.quiet and (tty or now - last_print >= 2.0 or snap.state != JobState.DOWNLOADING):
                if tty:
                    print("\r\033[K" + _line(snap), end="", file=sys.stderr, flush=True)
                else:
                    print(_line(snap), file=sys.stderr, flush=True)
                last_print = now
            if snap.state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.PAUSED):
                break
    except KeyboardInterrupt:
        manager.pause(job_id)
        manager.wait(job_id, timeout=10)
        if tty:
            print(file=sys.stderr)
        print(
            f"partial data kept in {manager.job(job_id).dest}; run the same command to resume",
            file=sys.stderr,
        )
        raise
    if tty and not args.quiet:
        print(file=sys.stderr)
    if snap.state != JobState.COMPLETED:
        raise DownloadError(
            f"{snap.error or snap.state.value}"
            + (
                f"\npartial data kept in {snap.dest}; run the same command to resume"
                # Only where there is something to resume: a download refused before it wrote
                # anything (an unsafe file name, a missing repo) must not promise a resume.
                if (snap.dest / PARTIAL_DIR).exists()
                else ""
            )
        )
    n = len(snap.files)
    if not args.quiet:
        print(f"verified {n} files, {format_bytes(snap.total_bytes)} (commit {snap.commit})", file=sys.stderr)
    print(snap.dest)
    return 0
