"""``trellis-chat --install-gpu-runtime``: the dialog's install, without a window (a server, a
script, a measurement). Prints the size first, then progress every few seconds; Ctrl+C pauses
(run it again to resume). ``--wheels DIR`` takes wheels downloaded elsewhere (same file names as
the lock) for a machine without a network."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from app.runtime.activate import runtime_root
from app.runtime.install import InstallCancelled, InstallProgress, RuntimeInstaller
from app.runtime.lock import shipped_locks
from app.runtime.variant import choose
from engine.units import format_bytes, format_duration

PRINT_EVERY = 5.0  # seconds between progress lines


def install_gpu_runtime(data_dir: Path, wheels: Path | None = None, driver_cuda: str | None = None) -> int:
    """Install the runtime that fits this machine's driver into ``data_dir``; the exit code."""
    if driver_cuda is None:
        from app.gpu_check import gather_facts

        facts = gather_facts()
        if facts.torch_cuda is not None and facts.cuda_available:
            print(f"torch {facts.torch_version} already runs on the GPU; nothing to install.")
            return 0
        if not (facts.driver_version or facts.nvidia_gpus):
            print("No GPU runtime to install: no NVIDIA GPU driver was found.", file=sys.stderr)
            return 1
        driver_cuda = facts.driver_cuda
    choice = choose(shipped_locks(), driver_cuda)
    if choice.lock is None:
        print(f"No GPU runtime to install: {choice.reason}", file=sys.stderr)
        return 1
    installer = RuntimeInstaller(choice.lock, runtime_root(data_dir))
    print(
        f"GPU runtime: {choice.reason}. {format_bytes(choice.lock.download_size)} to download, "
        f"about {format_bytes(installer.unpacked_size())} on disk in {installer.root}."
    )
    if wheels is not None:
        print(f"Taken from {wheels}: {format_bytes(installer.adopt_downloads(wheels))}.")
    state = {"printed": 0.0, "stage": ""}

    def show(p: InstallProgress) -> None:
        now = time.monotonic()
        new_stage = p.stage != state["stage"]
        state["stage"] = p.stage
        if p.stage == "download" and (new_stage or now - state["printed"] >= PRINT_EVERY or p.note):
            state["printed"] = now
            speed = f", {format_bytes(p.speed)}/s" if p.speed else ""
            left = f", {format_duration(p.eta)} left" if p.eta is not None else ""
            note = f" ({p.note})" if p.note else ""
            print(f"  {format_bytes(p.done)} of {format_bytes(p.total)}{speed}{left}{note}", flush=True)
        elif new_stage and p.stage in ("unpack", "check"):
            print("  unpacking…" if p.stage == "unpack" else "  checking that it finds the GPU…", flush=True)

    started = time.monotonic()
    try:
        folder = installer.install(show)
    except (InstallCancelled, KeyboardInterrupt):
        print("Paused; run the same command again to resume.", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - said in words, like the dialog does
        print(f"The GPU runtime could not be installed: {exc}", file=sys.stderr)
        return 1
    took = format_duration(time.monotonic() - started)
    print(f"Installed in {folder} ({took}). Restart Trellis Chat to use it.")
    return 0
