"""Which runtime fits this machine: the newest CUDA build whose CUDA version the NVIDIA driver
supports (``nvidia-smi`` prints that as "CUDA Version: 12.8"). PyPI's torch is built for CUDA
13.0 (driver 580 or newer); older drivers (535, 550, 570) take the cu126/cu128 builds."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass

from app.runtime.lock import RuntimeLock, version_key


def python_tag() -> str:
    """This interpreter's CPython ABI tag, e.g. ``cp311``: a runtime's wheels must match it."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def platform_fits(tag: str, system: str | None = None, machine: str | None = None) -> bool:
    """Whether wheels of platform ``tag`` (``manylinux_2_28_x86_64``, ``win_amd64``) run here."""
    system = system or sys.platform
    machine = (machine or platform.machine()).lower()
    if system.startswith("linux"):
        return tag.startswith("manylinux") and tag.endswith(machine)
    if system == "win32":
        return tag == ("win_amd64" if machine in ("amd64", "x86_64") else f"win_{machine}")
    return False  # macOS has no CUDA


@dataclass(frozen=True)
class Choice:
    lock: RuntimeLock | None
    reason: str  # why this lock, or why none (shown to the user)


def choose(locks: list[RuntimeLock], driver_cuda: str | None, python: str | None = None) -> Choice:
    """The lock for a driver that supports CUDA up to ``driver_cuda``, among those built for this
    Python (``python``, default this interpreter's tag)."""
    python = python or python_tag()
    usable = [lock for lock in locks if lock.python == python and platform_fits(lock.platform)]
    if not usable:
        return Choice(None, f"this release has no GPU runtime for Python {python} on {sys.platform}")
    if not driver_cuda or not version_key(driver_cuda):
        return Choice(None, "the NVIDIA driver did not say which CUDA version it supports (nvidia-smi)")
    driver = version_key(driver_cuda)
    fitting = [lock for lock in usable if version_key(lock.min_driver_cuda) <= driver]
    if not fitting:
        oldest = min(usable, key=lambda lock: version_key(lock.min_driver_cuda))
        return Choice(
            None,
            f"the NVIDIA driver supports CUDA up to {driver_cuda}; the GPU runtime needs at least "
            f"CUDA {oldest.min_driver_cuda}. Update the NVIDIA driver, then restart Trellis Chat.",
        )
    best = max(fitting, key=lambda lock: version_key(lock.cuda))
    return Choice(best, f"torch {best.torch} for CUDA {best.cuda} (the driver supports CUDA {driver_cuda})")
