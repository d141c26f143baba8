"""The GPU report says where models run and why, for situations we cannot all own: each case
states the facts a machine would show and checks the sentence a user reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.gpu_check import (
    GpuCheck,
    GpuDevice,
    GpuFacts,
    diagnose,
    gather_facts,
    parse_nvidia_smi,
    parse_proc_driver,
)

H200 = GpuDevice("NVIDIA H200", 150_000_000_000, (9, 0))
CUDA_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "compute_90")


def cuda_facts(**changes) -> GpuFacts:
    base = dict(
        torch_version="2.11.0+cu128",
        torch_cuda="12.8",
        cuda_available=True,
        devices=(H200,),
        arch_list=CUDA_ARCHS,
        driver_version="570.124.06",
        driver_cuda="12.8",
        nvidia_gpus=("NVIDIA H200",),
        platform="linux",
    )
    base.update(changes)
    return GpuFacts(**base)


def test_gpu_found_names_the_gpu_memory_and_driver() -> None:
    report = diagnose(cuda_facts())
    assert report.uses_gpu
    assert report.headline == "GPU found: NVIDIA H200, 140 GiB with driver 570.124.06. Models run on the GPU."
    assert report.short == "GPU: NVIDIA H200"
    assert report.advice is None
    assert "Runtime: torch 2.11.0+cu128, CUDA 12.8." in report.details


def test_more_than_one_gpu_is_counted() -> None:
    report = diagnose(cuda_facts(devices=(H200, H200, H200)))
    assert report.headline.startswith("GPU found: NVIDIA H200 (and 2 more), 140 GiB")


def test_cpu_build_without_nvidia_hardware() -> None:
    report = diagnose(GpuFacts(torch_version="2.13.0+cpu", platform="linux"))
    assert not report.uses_gpu
    assert report.headline == "Using the CPU because no NVIDIA GPU was found on this computer."
    assert report.short == "CPU"
    assert report.advice is None
    assert "Models still run on the CPU, correctly but more slowly." in report.details


def test_cpu_build_on_a_machine_with_an_nvidia_gpu_says_so_and_what_to_install() -> None:
    facts = GpuFacts(torch_version="2.13.0+cpu", driver_version="550.54.15", nvidia_gpus=("NVIDIA RTX 4090",))
    report = diagnose(facts)
    assert not report.uses_gpu
    assert report.headline == (
        "Using the CPU because this installation has the CPU-only build of torch, although "
        "NVIDIA RTX 4090 is present with driver 550.54.15."
    )
    assert "GPU runtime" in report.advice and "download.pytorch.org" in report.advice


def test_macos_explains_apple_gpus_are_not_used() -> None:
    report = diagnose(GpuFacts(torch_version="2.13.0", platform="darwin"))
    assert "Apple GPUs are not used yet" in report.headline


def test_driver_too_old_for_the_torch_build() -> None:
    facts = cuda_facts(cuda_available=False, devices=(), driver_version="470.82.01", driver_cuda="11.4")
    report = diagnose(facts)
    assert not report.uses_gpu
    assert report.headline == (
        "Using the CPU because the NVIDIA driver 470.82.01 supports CUDA up to 11.4, "
        "but this build of torch needs CUDA 12.8."
    )
    assert report.advice.startswith("Update the NVIDIA driver")


def test_cuda_visible_devices_hiding_every_gpu() -> None:
    report = diagnose(cuda_facts(cuda_available=False, devices=(), visible_devices=""))
    assert "CUDA_VISIBLE_DEVICES=''" in report.headline and "hides every GPU" in report.headline


def test_cuda_build_without_a_driver() -> None:
    facts = cuda_facts(
        cuda_available=False, devices=(), driver_version=None, driver_cuda=None, nvidia_gpus=()
    )
    report = diagnose(facts)
    assert "no NVIDIA GPU driver is loaded" in report.headline


def test_cuda_start_failure_quotes_torchs_reason() -> None:
    facts = cuda_facts(cuda_available=False, devices=(), cuda_error="CUDA initialization: CUDA unknown error")
    report = diagnose(facts)
    assert report.headline == (
        "Using the CPU because CUDA could not start: CUDA initialization: CUDA unknown error."
    )


def test_gpu_older_than_the_build_supports() -> None:
    old = GpuDevice("Tesla K80", 12 * 2**30, (3, 7))
    report = diagnose(cuda_facts(devices=(old,)))
    assert not report.uses_gpu
    assert "Tesla K80 (compute capability 3.7) is not supported" in report.headline
    assert "sm_50" in report.details[-1]


def test_a_newer_gpu_runs_through_ptx() -> None:
    newer = GpuDevice("NVIDIA B200", 180 * 2**30, (10, 0))
    assert diagnose(cuda_facts(devices=(newer,))).uses_gpu  # compute_90 PTX is JIT-compiled


def test_cpu_chosen_in_settings_while_a_gpu_is_there() -> None:
    report = diagnose(cuda_facts(preference="cpu"))
    assert not report.uses_gpu
    assert report.headline == "Using the CPU because Settings › Device is set to CPU."
    assert report.details[0].startswith("GPU found: NVIDIA H200")


def test_cuda_chosen_in_settings_without_a_usable_gpu_warns_that_loading_fails() -> None:
    report = diagnose(GpuFacts(torch_version="2.13.0+cpu", preference="cuda", platform="linux"))
    assert "asks for the CUDA GPU" in report.headline and "Loading a model will fail" in report.headline


def test_torch_that_does_not_import() -> None:
    report = diagnose(GpuFacts(torch_error="ImportError: libtorch_cpu.so: cannot open shared object file"))
    assert not report.uses_gpu
    assert report.headline.startswith("Models cannot run")
    assert "libtorch_cpu.so" in report.details[0]


def test_driver_parsers_read_real_tool_output() -> None:
    proc = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert parse_proc_driver(proc) == "550.54.15"
    assert parse_proc_driver("something else") is None
    query = "NVIDIA H200, 570.124.06\nNVIDIA H200, 570.124.06\n"
    header = "| NVIDIA-SMI 570.124.06   Driver Version: 570.124.06   CUDA Version: 12.8     |\n"
    assert parse_nvidia_smi(query, header) == ("570.124.06", "12.8", ("NVIDIA H200", "NVIDIA H200"))
    assert parse_nvidia_smi("", "") == (None, None, ())


def test_gather_facts_on_this_machine_agrees_with_torch() -> None:
    torch = pytest.importorskip("torch")
    facts = gather_facts()
    assert facts.torch_version == torch.__version__
    assert facts.torch_cuda == torch.version.cuda
    assert facts.cuda_available == torch.cuda.is_available()
    report = diagnose(facts)
    assert report.uses_gpu == torch.cuda.is_available()
    assert report.headline.startswith("GPU found:" if report.uses_gpu else "Using the CPU because")


def test_the_check_runs_off_the_gui_thread_and_reports_on_it(qtbot) -> None:
    import threading

    from PySide6.QtCore import QObject

    seen: list[tuple[str, object]] = []
    holder = QObject()
    check = GpuCheck(holder)
    check.finished.connect(lambda report: seen.append((threading.current_thread().name, report)))
    with qtbot.waitSignal(check.finished, timeout=120_000):
        check.start()
    thread_name, report = seen[0]
    assert thread_name == threading.main_thread().name  # delivered on the GUI thread
    assert report.headline
    from app import gpu_check

    assert gpu_check.last_report() is report  # About reuses it without checking again


def test_gather_facts_reads_each_gpus_free_memory(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    props = SimpleNamespace(name="NVIDIA L4", total_memory=24 << 30, major=8, minor=9)
    free = {0: 20 << 30}  # GPU 1's figure cannot be read: its size stands in

    def mem_get_info(index: int) -> tuple[int, int]:
        if index not in free:
            raise RuntimeError("CUDA error: not available")
        return free[index], props.total_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_89"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    devices = gather_facts().devices
    assert [d.free_bytes for d in devices] == [20 << 30, 0]
    assert [d.usable_bytes for d in devices] == [20 << 30, 24 << 30]
