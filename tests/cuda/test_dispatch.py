"""CPU tests of the dispatch and fallback logic of engine.kernels (no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import kernels
from engine.cli import build_parser, main
from engine.exl3 import EXL3Linear
from engine.kernels import gemv, loader
from engine.options import EngineOptions


@pytest.fixture(autouse=True)
def _fresh_kernels(monkeypatch):
    monkeypatch.setattr(loader, "_settings", loader.Settings())  # restored after the test
    kernels.reset()
    yield
    kernels.reset()


def _no_build(*args, **kwargs):
    raise AssertionError("loader.load must not be called here")


def _layer(k: int = 3, codebook_flag: str | None = "mcg", mode: str = "streaming") -> EXL3Linear:
    g = torch.Generator().manual_seed(k)
    t = {
        "trellis": torch.randint(-(2**15), 2**15, (16, 8, 16 * k), dtype=torch.int16, generator=g),
        "suh": (torch.rand(256, generator=g) + 0.5).half(),
        "svh": (torch.rand(128, generator=g) + 0.5).half(),
    }
    if codebook_flag:
        t[codebook_flag] = torch.tensor(0, dtype=torch.int32)
    return EXL3Linear.from_tensors(t, 256, 128, bias=None, mode=mode)


def test_cpu_machine_never_builds(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loader, "load", _no_build)
    assert kernels.extension() is None
    assert kernels.status()["reason"] == "no CUDA GPU"
    assert kernels.status()["available"] is False


def test_cpu_tensors_take_the_reference_path(monkeypatch) -> None:
    # Even where a GPU exists, CPU tensors never reach the extension.
    monkeypatch.setattr(loader, "load", _no_build)
    layer = _layer()
    x = torch.randn(3, 256)
    assert gemv.exl3_gemm(x, layer) is None
    expected = x.double() @ layer.reconstruct().double().t()
    y = layer(x)  # through the hook in EXL3Linear.forward, back to the torch reference
    assert y.shape == (3, 128)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_dense_layers_are_not_dispatched(monkeypatch) -> None:
    monkeypatch.setattr(loader, "load", _no_build)
    assert gemv.exl3_gemm(torch.randn(2, 256), _layer(mode="dense")) is None


def test_extension_turned_off_by_the_options(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader, "load", _no_build)
    EngineOptions(use_extension=False).configure_kernels()
    assert kernels.extension() is None
    assert "turned off" in kernels.status()["reason"]
    assert EngineOptions.from_environment({"TRELLIS_NO_EXT": "1"}).use_extension is False
    assert EngineOptions.from_environment({"TRELLIS_NO_EXT": "0"}).use_extension is True


def test_configure_forgets_a_module_loaded_under_other_settings(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []

    def fake_load(**kwargs):
        seen.append(kwargs)
        return object()

    monkeypatch.setattr(loader, "load", fake_load)
    first = kernels.extension()
    assert first is not None and kernels.extension() is first  # loaded once
    kernels.configure(prebuilt_dir=tmp_path)
    assert kernels.extension() is not first
    assert seen[-1] == {"prebuilt_dir": tmp_path, "cache_dir": None}
    kernels.configure(prebuilt_dir=tmp_path)  # the same settings: the module stays
    assert len(seen) == 2


def test_build_failure_falls_back_once_with_a_message(monkeypatch, capsys) -> None:
    calls = []

    def failing_load(*args, **kwargs):
        calls.append(1)
        raise loader.ExtensionUnavailable("no CUDA toolkit found (nvcc)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader, "load", failing_load)
    assert kernels.extension() is None
    assert kernels.extension() is None  # cached: no second attempt, no second message
    err = capsys.readouterr().err
    assert err.count("CUDA extension unavailable") == 1
    assert "nvcc" in err and "torch reference" in err
    assert len(calls) == 1
    assert "nvcc" in kernels.status()["reason"]


def test_toolchain_check_names_the_problem(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(loader.ExtensionUnavailable, match="no CUDA support"):
        loader.check_toolchain()


def test_detect_arch_without_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(loader.ExtensionUnavailable, match="no CUDA GPU"):
        loader.detect_arch()


def test_old_gpu_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(loader.ExtensionUnavailable, match="7.5"):
        loader.detect_arch()


def test_sources_hash_covers_every_source_and_header() -> None:
    names = sorted(p.name for p in loader.EXT_DIR.iterdir() if p.suffix in (".cu", ".cpp", ".cuh", ".h"))
    assert names == sorted((*loader.SOURCES, *loader.HEADERS))
    assert loader.sources_hash() == loader.sources_hash()
    assert len(loader.sources_hash()) == 16


def test_prebuilt_with_other_sources_is_ignored(tmp_path, capsys) -> None:
    meta = {
        "file": "x.so",
        "name": "trellis_ext",
        "sources": "0" * 16,
        "torch": "0.0",
        "cuda": "0",
        "arch": "9.0",
    }
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert loader.load_prebuilt(tmp_path, "9.0") is None
    assert "does not match" in capsys.readouterr().err
    assert loader.load_prebuilt(None, "9.0") is None


def test_prebuilt_and_cache_folders_come_from_the_options(tmp_path) -> None:
    env = {"TRELLIS_EXT_PREBUILT": str(tmp_path / "pre"), "TRELLIS_EXT_CACHE": str(tmp_path / "jit")}
    options = EngineOptions.from_environment(env)
    assert options.extension_prebuilt_dir == tmp_path / "pre"
    assert options.extension_cache_dir == tmp_path / "jit"
    options.configure_kernels()
    assert loader.settings() == loader.Settings(True, tmp_path / "pre", tmp_path / "jit")


def test_build_dir_is_keyed_by_torch_cuda_and_arch(tmp_path) -> None:
    d = loader.build_dir("9.0", tmp_path)
    assert d.parent == tmp_path
    assert d.name.endswith("-sm90") and d.name.startswith(f"torch{torch.__version__.split('+')[0]}")


def test_cli_registers_the_commands() -> None:
    parser = build_parser()
    args = parser.parse_args(["build-ext", "--arch", "9.0", "--force"])
    assert args.arch == "9.0" and args.force
    args = parser.parse_args(["bench-kernels", "--bits", "4", "--batch", "1"])
    assert args.bits == "4" and args.batch == "1"


def test_build_ext_command_reports_failure(monkeypatch, capsys) -> None:
    def failing_load(*args, **kwargs):
        raise loader.ExtensionUnavailable("ninja is not installed (pip install ninja)")

    monkeypatch.setattr(loader, "load", failing_load)
    assert main(["build-ext", "--arch", "9.0"]) == 1
    err = capsys.readouterr().err
    assert "ninja is not installed" in err and "torch reference path" in err


def test_build_ext_command_builds_into_the_configured_folders(monkeypatch, tmp_path, capsys) -> None:
    seen = {}

    class Built:
        __file__ = str(tmp_path / "trellis_ext.so")

    def fake_load(**kwargs):
        seen.update(kwargs)
        return Built()

    monkeypatch.setattr(loader, "load", fake_load)
    monkeypatch.setenv("TRELLIS_EXT_CACHE", str(tmp_path / "jit"))
    assert main(["build-ext", "--arch", "9.0"]) == 0
    assert seen["arch"] == "9.0" and seen["cache_dir"] == tmp_path / "jit" and seen["prebuilt_dir"] is None
    assert "CUDA extension ready" in capsys.readouterr().out


def test_viterbi_tables_are_told_apart_by_codebook() -> None:
    from engine.convert.viterbi import codebook_of_table
    from engine.exl3.codebooks import CODEBOOKS, codebook_table
    from engine.kernels.viterbi import viterbi_encode

    for name in CODEBOOKS:
        table = codebook_table(name, "cpu")
        assert codebook_of_table(table) == name
        assert codebook_of_table(table.clone()) == name  # by value, not only the cached tensor
    other = codebook_table("mcg", "cpu").clone()
    other[7] += 1.0
    assert codebook_of_table(other) is None
    assert viterbi_encode(torch.zeros(2, 256), 4, "mcg") is None  # CPU tiles: the torch path


def test_engine_options_from_the_environment() -> None:
    assert EngineOptions.from_environment({}) == EngineOptions()
    every = EngineOptions.from_environment(
        {
            "TRELLIS_NO_EXT": "1",
            "TRELLIS_GEMV_TUNE": "0",
            "TRELLIS_STEP_TUNE": "yes",
            "TRELLIS_NO_GRAPHS": "1",
            "TRELLIS_NO_PIPELINE": "1",
            "TRELLIS_HOST_SAMPLING": "1",
        }
    )
    assert every == EngineOptions(
        use_extension=False,
        gemv_tuning=False,
        step_tuning=True,
        cuda_graphs=False,
        pipelined_decode=False,
        sampling_on_device=False,
    )
    # "" and "0" leave a switch at its default, whatever its polarity.
    switches = ("TRELLIS_NO_EXT", "TRELLIS_STEP_TUNE", "TRELLIS_NO_GRAPHS", "TRELLIS_HOST_SAMPLING")
    quiet = dict.fromkeys(switches, "0")
    assert EngineOptions.from_environment({**quiet, "TRELLIS_GEMV_TUNE": ""}) == EngineOptions()
