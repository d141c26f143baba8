"""The GPU and driver check: one plain-language sentence about where models will run, and why.

Two halves, kept apart so the wording can be tested for every situation without owning that
hardware:

- :func:`gather_facts` looks at the machine: the torch build (``torch.version.cuda``), whether
  CUDA starts, the GPUs torch sees, and, independently of torch, the NVIDIA driver
  (``/proc/driver/nvidia/version``, ``nvidia-smi``). Seeing the driver without torch is what lets
  us say "you have a GPU, but this install has the CPU build of torch" instead of just "no GPU".
- :func:`diagnose` turns those facts into a :class:`GpuReport`: "GPU found: ..." or "Using the CPU
  because ...", plus what the user can do about it.

Importing torch takes seconds on a cold disk, so the GUI never calls :func:`gather_facts` on its
thread: :class:`GpuCheck` runs it on a Python thread and delivers the report through a queued
signal. The decision mirrors ``engine.model.resolve_device`` ("auto" means CUDA whenever
``torch.cuda.is_available()``), so the report says what the engine will actually do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from engine.units import format_bytes


@dataclass(frozen=True)
class GpuDevice:
    name: str
    memory_bytes: int
    capability: tuple[int, int]
    # Free when the check ran (before this process loads a model; others' use counted), 0 where
    # it could not be read: what the load options' automatic choice compares with.
    free_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """Free memory where known, else the GPU's size."""
        return self.free_bytes or self.memory_bytes


@dataclass(frozen=True)
class GpuFacts:
    """What :func:`gather_facts` saw. Every field has a neutral default so tests state only what
    matters for the case they check."""

    torch_version: str | None = None  # None: torch could not be imported
    torch_error: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda; None for a CPU-only build
    cuda_available: bool = False
    cuda_error: str | None = None  # what torch said when CUDA did not start
    devices: tuple[GpuDevice, ...] = ()
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): the GPU generations it has code for
    driver_version: str | None = None  # NVIDIA kernel driver, seen without torch
    driver_cuda: str | None = None  # newest CUDA version that driver supports (nvidia-smi)
    nvidia_gpus: tuple[str, ...] = ()  # GPU names nvidia-smi lists
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES as set for this process
    preference: str = "auto"  # the engine.device setting: auto, cpu or cuda
    platform: str = sys.platform


@dataclass(frozen=True)
class GpuReport:
    uses_gpu: bool
    headline: str  # one sentence, shown in the status bar and at the top of About
    details: tuple[str, ...] = ()
    advice: str | None = None  # what the user can do, when there is something to do
    facts: GpuFacts = field(default_factory=GpuFacts)

    @property
    def short(self) -> str:
        """A few words for the status bar's permanent label."""
        if self.uses_gpu and self.facts.devices:
            return f"GPU: {self.facts.devices[0].name}"
        return "CPU"

    def text(self) -> str:
        lines = [self.headline, *self.details]
        if self.advice:
            lines.append(f"What to do: {self.advice}")
        return "\n".join(lines)


def _major(version: str | None) -> int | None:
    match = re.match(r"(\d+)", version or "")
    return int(match.group(1)) if match else None


def _arch_supported(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Whether torch has code that runs on a GPU of ``capability``: a kernel image for the same
    major generation at or below its minor version, or PTX it can JIT-compile for a newer GPU."""
    if not arch_list:
        return True  # torch did not say; do not invent a problem
    major, minor = capability
    for arch in arch_list:
        match = re.match(r"(sm|compute)_(\d+)(\d)", arch)
        if not match:
            continue
        kind, a_major, a_minor = match.group(1), int(match.group(2)), int(match.group(3))
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def diagnose(facts: GpuFacts) -> GpuReport:
    """The plain-language report for ``facts``. The first matching situation wins."""
    f = facts
    if f.torch_version is None:
        return GpuReport(
            False,
            "Models cannot run: the engine's runtime (torch) could not be loaded.",
            (f"The error was: {f.torch_error}",) if f.torch_error else (),
            "Reinstall Trellis Chat; if you installed from source, reinstall torch in its environment.",
            f,
        )

    gpu = f.devices[0] if f.devices else None
    driver = f" with driver {f.driver_version}" if f.driver_version else ""
    runtime = f"torch {f.torch_version}" + (f", CUDA {f.torch_cuda}" if f.torch_cuda else " (CPU build)")
    details: list[str] = [f"Runtime: {runtime}."]
    if f.driver_version:
        supports = f", supports CUDA up to {f.driver_cuda}" if f.driver_cuda else ""
        details.append(f"NVIDIA driver {f.driver_version}{supports}.")

    if f.cuda_available and gpu is not None:
        if not _arch_supported(gpu.capability, f.arch_list):
            cap = f"{gpu.capability[0]}.{gpu.capability[1]}"
            return GpuReport(
                False,
                f"Using the CPU because your GPU {gpu.name} (compute capability {cap}) is not supported "
                f"by this build of torch.",
                (*details, f"This build has GPU code for: {', '.join(f.arch_list)}."),
                "Choose CPU under Settings › Device (loading on the GPU would fail), or install a torch "
                "build that still supports this GPU.",
                f,
            )
        others = f" (and {len(f.devices) - 1} more)" if len(f.devices) > 1 else ""
        found = f"GPU found: {gpu.name}{others}, {format_bytes(gpu.memory_bytes, decimals=0)}{driver}."
        if f.preference == "cpu":
            return GpuReport(
                False,
                "Using the CPU because Settings › Device is set to CPU.",
                (found, *details),
                "Choose Automatic under Settings › Device to run models on the GPU.",
                f,
            )
        return GpuReport(True, f"{found} Models run on the GPU.", tuple(details), None, f)

    # No usable CUDA device from here on: say why, most specific reason first.
    if f.preference == "cpu":
        reason = "Settings › Device is set to CPU"
        advice = None
    elif f.torch_cuda is None:
        if f.driver_version or f.nvidia_gpus:
            name = f.nvidia_gpus[0] if f.nvidia_gpus else "an NVIDIA GPU"
            reason = f"this installation has the CPU-only build of torch, although {name} is present{driver}"
            advice = (
                "Install the GPU runtime: the app offers it at startup, or run trellis-chat "
                "--install-gpu-runtime (from a source install: pip install torch from "
                "https://download.pytorch.org/whl/cu128)."
            )
        elif f.platform == "darwin":
            reason = "the engine's GPU path needs an NVIDIA GPU with CUDA; Apple GPUs are not used yet"
            advice = None
        else:
            reason = "no NVIDIA GPU was found on this computer"
            advice = None
    elif f.visible_devices is not None and f.visible_devices.strip() in ("", "-1"):
        reason = f"the environment variable CUDA_VISIBLE_DEVICES={f.visible_devices!r} hides every GPU"
        advice = "Start Trellis Chat without CUDA_VISIBLE_DEVICES set (or list your GPU in it)."
    elif not f.driver_version and not f.nvidia_gpus:
        reason = "no NVIDIA GPU driver is loaded (no GPU, or the driver is not installed)"
        advice = "If this computer has an NVIDIA GPU, install NVIDIA's driver and restart."
    elif _major(f.driver_cuda) is not None and _major(f.driver_cuda) < (_major(f.torch_cuda) or 0):
        reason = (
            f"the NVIDIA driver {f.driver_version} supports CUDA up to {f.driver_cuda}, "
            f"but this build of torch needs CUDA {f.torch_cuda}"
        )
        advice = f"Update the NVIDIA driver to one that supports CUDA {f.torch_cuda}, then restart."
    else:
        reason = "CUDA could not start" + (f": {f.cuda_error}" if f.cuda_error else "")
        advice = "Restart the computer; if that does not help, reinstall NVIDIA's driver."

    headline = f"Using the CPU because {reason}."
    if f.preference == "cuda":
        headline = (
            f"Settings › Device asks for the CUDA GPU, but none is usable: {reason}. "
            "Loading a model will fail; choose Automatic or CPU."
        )
    details.append("Models still run on the CPU, correctly but more slowly.")
    return GpuReport(False, headline, tuple(details), advice, f)


# -- looking at the machine -------------------------------------------------------------------------------


def parse_proc_driver(text: str) -> str | None:
    """The driver version from ``/proc/driver/nvidia/version``
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ...")."""
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None


def parse_nvidia_smi(query: str, header: str) -> tuple[str | None, str | None, tuple[str, ...]]:
    """(driver version, newest CUDA the driver supports, GPU names) from ``nvidia-smi
    --query-gpu=name,driver_version --format=csv,noheader`` and plain ``nvidia-smi`` output."""
    names: list[str] = []
    driver = None
    for line in query.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0]:
            names.append(parts[0])
            driver = driver or parts[1]
    match = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return driver, match.group(1) if match else None, tuple(names)


def _driver_from_proc() -> str | None:
    try:
        return parse_proc_driver(Path("/proc/driver/nvidia/version").read_text(errors="replace"))
    except OSError:
        return None


def _nvidia_smi() -> tuple[str | None, str | None, tuple[str, ...]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None, ()
    try:
        query = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        header = subprocess.run([exe], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None, ()
    return parse_nvidia_smi(query.stdout, header.stdout)


def _free_memory(torch: Any, index: int) -> int:
    """GPU ``index``'s free bytes as the engine will see them (0 where CUDA cannot say)."""
    try:
        return int(torch.cuda.mem_get_info(index)[0])
    except Exception:  # noqa: BLE001 - a missing figure is no finding: the size stands in for it
        return 0


def gather_facts(preference: str = "auto") -> GpuFacts:
    """Look at this machine. Imports torch (seconds): call it off the GUI thread."""
    driver, driver_cuda, names = _nvidia_smi()
    driver = driver or _driver_from_proc()
    common: dict[str, Any] = dict(
        driver_version=driver,
        driver_cuda=driver_cuda,
        nvidia_gpus=names,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        preference=preference,
    )
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any failure to import is the finding itself
        return GpuFacts(torch_error=f"{type(exc).__name__}: {exc}", **common)
    cuda_error = None
    available = False
    devices: list[GpuDevice] = []
    arch_list: tuple[str, ...] = ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = bool(torch.cuda.is_available())
            if available:
                arch_list = tuple(torch.cuda.get_arch_list())
                for i in range(torch.cuda.device_count()):
                    props = torch.cuda.get_device_properties(i)
                    capability = (props.major, props.minor)
                    devices.append(
                        GpuDevice(props.name, int(props.total_memory), capability, _free_memory(torch, i))
                    )
        except Exception as exc:  # noqa: BLE001 - a CUDA init failure is reported, not raised
            available = False
            cuda_error = f"{type(exc).__name__}: {exc}"
    if not available and cuda_error is None and caught:
        # torch explains a failed CUDA start in a UserWarning ("CUDA initialization: ...").
        cuda_error = str(caught[-1].message).strip().splitlines()[0]
    return GpuFacts(
        torch_version=str(torch.__version__),
        torch_cuda=torch.version.cuda,
        cuda_available=available and bool(devices),
        cuda_error=cuda_error,
        devices=tuple(devices),
        arch_list=arch_list,
        **common,
    )


def check(preference: str = "auto") -> GpuReport:
    return diagnose(gather_facts(preference))


_last: GpuReport | None = None


def last_report() -> GpuReport | None:
    """The most recent report of this process (the About dialog shows it without waiting)."""
    return _last


class GpuCheck(QObject):
    """Runs :func:`check` on a Python thread; ``finished`` arrives on the GUI thread."""

    finished = Signal(object)  # GpuReport

    def start(self, preference: str = "auto") -> None:
        threading.Thread(target=self._run, args=(preference,), name="gpu-check", daemon=True).start()

    def _run(self, preference: str) -> None:
        global _last
        try:
            report = check(preference)
        except Exception as exc:  # noqa: BLE001 - the check must never take the app down
            report = GpuReport(False, f"The GPU check failed: {type(exc).__name__}: {exc}")
        _last = report
        # Emitted from this thread to an object owned by the GUI thread: Qt queues the delivery.
        self.finished.emit(report)
