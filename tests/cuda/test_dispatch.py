"""CPU tests of the dispatch and fallback logic of engine.ops / engine.ext_build (no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import ext_build, ops
from engine.cli import build_parser, main
from engine.quant import EXL3Linear
from engine.quant.hadamard import blockwise_hadamard
from engine.quant.reconstruct import decode_trellis


@pytest.fixture(autouse=True)
def _fresh_ops(monkeypatch):
    monkeypatch.delenv(ops.DISABLE_ENV, raising=False)
    monkeypatch.delenv("TRELLIS_EXT_PREBUILT", raising=False)
    ops.reset()
    yield
    ops.reset()


def _no_build(*args, **kwargs):
    raise AssertionError("ext_build.load must not be called here")


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
    monkeypatch.setattr(ext_build, "load", _no_build)
    assert ops.extension() is None
    assert ops.status()["reason"] == "no CUDA GPU"
    assert ops.status()["available"] is False


def test_cpu_tensors_take_the_reference_path(monkeypatch) -> None:
    # Even where a GPU exists, CPU tensors never reach the extension.
    monkeypatch.setattr(ext_build, "load", _no_build)
    layer = _layer()
    x = torch.randn(3, 256)
    assert ops.exl3_gemm(x, layer) is None
    expected = x.double() @ layer.reconstruct().double().t()
    y = layer(x)  # through the hook in EXL3Linear.forward, back to the torch reference
    assert y.shape == (3, 128)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_dense_layers_are_not_dispatched(monkeypatch) -> None:
    monkeypatch.setattr(ext_build, "load", _no_build)
    assert ops.exl3_gemm(torch.randn(2, 256), _layer(mode="dense")) is None


def test_disable_variable(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ext_build, "load", _no_build)
    monkeypatch.setenv(ops.DISABLE_ENV, "1")
    assert ops.extension() is None
    assert ops.DISABLE_ENV in ops.status()["reason"]


def test_build_failure_falls_back_once_with_a_message(monkeypatch, capsys) -> None:
    calls = []

    def failing_load(*args, **kwargs):
        calls.append(1)
        raise ext_build.ExtensionUnavailable("no CUDA toolkit found (nvcc)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ext_build, "load", failing_load)
    assert ops.extension() is None
    assert ops.extension() is None  # cached: no second attempt, no second message
    err = capsys.readouterr().err
    assert err.count("CUDA extension unavailable") == 1
    assert "nvcc" in err and "torch reference" in err
    assert len(calls) == 1
    assert "nvcc" in ops.status()["reason"]


def test_toolchain_check_names_the_problem(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ext_build.ExtensionUnavailable, match="no CUDA support"):
        ext_build.check_toolchain()


def test_detect_arch_without_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ext_build.ExtensionUnavailable, match="no CUDA GPU"):
        ext_build.detect_arch()


def test_old_gpu_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(ext_build.ExtensionUnavailable, match="7.5"):
        ext_build.detect_arch()


def test_sources_hash_covers_every_source_and_header() -> None:
    names = sorted(p.name for p in ext_build.EXT_DIR.iterdir() if p.suffix in (".cu", ".cpp", ".cuh", ".h"))
    assert names == sorted((*ext_build.SOURCES, *ext_build.HEADERS))
    assert ext_build.sources_hash() == ext_build.sources_hash()
    assert len(ext_build.sources_hash()) == 16


def test_prebuilt_with_other_sources_is_ignored(monkeypatch, tmp_path, capsys) -> None:
    meta = {
        "file": "x.so",
        "name": "trellis_ext",
        "sources": "0" * 16,
        "torch": "0.0",
        "cuda": "0",
        "arch": "9.0",
    }
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setenv("TRELLIS_EXT_PREBUILT", str(tmp_path))
    assert ext_build._load_prebuilt("9.0") is None
    assert "does not match" in capsys.readouterr().err


def test_build_dir_is_keyed_by_torch_cuda_and_arch(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TRELLIS_EXT_CACHE", str(tmp_path))
    d = ext_build.build_dir("9.0")
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
        raise ext_build.ExtensionUnavailable("ninja is not installed (pip install ninja)")

    monkeypatch.setattr(ext_build, "load", failing_load)
    assert main(["build-ext", "--arch", "9.0"]) == 1
    err = capsys.readouterr().err
    assert "ninja is not installed" in err and "torch reference path" in err


def test_reference_fallbacks_of_the_helpers() -> None:
    layer = _layer(k=4, codebook_flag="mul1")
    q = ops.exl3_decode(layer.trellis, "mul1")
    assert torch.equal(q.view(torch.int16), decode_trellis(layer.trellis, "mul1").view(torch.int16))
    x = torch.randn(5, 256)
    pre = (torch.rand(256) + 0.5).half()
    post = (torch.rand(256) + 0.5).half()
    got = ops.hadamard128(x, pre, post, torch.float32)
    expected = blockwise_hadamard(x.double() * pre.double(), dim=-1) * post.double()
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
