"""Prebuilt extension modules on a CPU machine: manifests matched against (sources, torch, CUDA,
Python, GPU generation), the folders searched, a fitting module loaded instead of a JIT build, and
the reason in ``kernels.status()`` when none fits and no toolkit exists."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import loader, prebuilt

PY = f"{sys.version_info.major}.{sys.version_info.minor}"
TORCH = torch.__version__.split("+")[0]
ARCHS = ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0"]


def write_prebuilt(folder: Path, *, cuda: str = "12.8", archs=ARCHS, **changes) -> Path:
    """A manifest and, as its "module", a Python file (importlib loads either the same way)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = prebuilt.artifact_stem(changes.get("torch", TORCH), cuda)
    (folder / f"{stem}.py").write_text(f"WHERE = {str(folder)!r}\n")
    meta = prebuilt.manifest_json(f"{stem}.py", loader.sources_hash(), TORCH, cuda, PY, list(archs))
    meta.update(changes)
    path = folder / f"{stem}.json"
    path.write_text(json.dumps(meta))
    return path


def target(arch: str = "8.9", cuda: str = "12.8") -> prebuilt.Target:
    return prebuilt.Target(loader.sources_hash(), TORCH, cuda, PY, arch)


@pytest.mark.parametrize(
    "arch, covered",
    [("8.0", True), ("8.6", True), ("8.7", True), ("9.0", True), ("10.0", True), ("12.1", True),
     ("7.5", False), ("10.3", True), ("11.0", False)],
)  # fmt: skip
def test_a_gpu_is_covered_by_code_for_its_generation_at_or_below_its_minor(arch, covered) -> None:
    assert prebuilt.arch_covered(tuple(ARCHS), arch) is covered
    assert not prebuilt.arch_covered(("9.0",), "10.0")  # no forward compatibility across majors


@pytest.mark.parametrize(
    "changes, tgt, says",
    [
        ({"sources": "0" * 16}, target(), "other extension sources"),
        ({"torch": "2.12.0"}, target(), "torch 2.12.0"),
        ({}, target(cuda="13.0"), "this torch has CUDA 13.0"),
        ({"python": "3.12"}, target(), "Python 3.12"),
        ({"archs": ["9.0"]}, target("8.9"), "no code for this GPU (sm_89); it has sm_90"),
    ],
)
def test_each_mismatch_is_named(tmp_path: Path, changes, tgt, says) -> None:
    path = write_prebuilt(tmp_path, **changes)
    manifest, reasons = prebuilt.find([tmp_path], tgt)
    assert manifest is None
    assert len(reasons) == 1 and says in reasons[0] and path.name in reasons[0]


def test_the_first_fitting_manifest_wins_and_legacy_meta_json_is_read(tmp_path: Path) -> None:
    write_prebuilt(tmp_path / "a", cuda="13.0")  # wrong CUDA: passed over
    good = write_prebuilt(tmp_path / "b")
    manifest, reasons = prebuilt.find([tmp_path / "a", tmp_path / "b"], target())
    assert manifest is not None and manifest.path == good and len(reasons) == 1
    legacy = tmp_path / "c"
    legacy.mkdir()
    (legacy / "mod.so").write_bytes(b"")
    meta = {"file": "mod.so", "name": "trellis_ext", "sources": loader.sources_hash(), "torch": TORCH,
            "cuda": "12.8", "arch": "9.0", "python": PY}  # fmt: skip
    (legacy / "meta.json").write_text(json.dumps(meta))
    manifest, _ = prebuilt.find([legacy], target("9.0"))
    assert manifest is not None and manifest.archs == ("9.0",)
    assert prebuilt.find([legacy], target("8.9"))[0] is None  # the old form: one architecture


def test_a_broken_manifest_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "trellis_ext-x.json").write_text("{not json")
    manifest, reasons = prebuilt.find([tmp_path], target())
    assert manifest is None and "not a prebuilt-extension manifest" in reasons[0]


def test_folders_are_searched_configured_then_runtime_then_package(tmp_path: Path) -> None:
    torch_dir = tmp_path / "site-packages" / "torch"
    dirs = prebuilt.search_dirs(tmp_path / "mine", torch_dir)
    assert dirs == [
        tmp_path / "mine",
        tmp_path / "site-packages" / "trellis_ext_prebuilt",
        prebuilt.PACKAGE_DIR,
    ]
    assert prebuilt.search_dirs(None, None) == [prebuilt.PACKAGE_DIR]


@pytest.fixture
def cuda_torch(monkeypatch):
    """This CPU torch dressed as a CUDA 12.8 build on an sm_89 GPU without a toolkit."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader, "detect_arch", lambda: "8.9")

    def no_toolkit() -> None:
        raise loader.ExtensionUnavailable("no CUDA toolkit found (nvcc)")

    monkeypatch.setattr(loader, "check_toolchain", no_toolkit)
    loader.reset()
    yield
    loader.configure()
    loader.reset()


def test_a_fitting_prebuilt_module_is_loaded_instead_of_a_build(tmp_path: Path, cuda_torch) -> None:
    write_prebuilt(tmp_path)
    module = loader.load(prebuilt_dir=tmp_path)
    assert module.WHERE == str(tmp_path)
    info = loader.info()
    assert info.prebuilt and info.arch == ",".join(ARCHS) and info.build_dir == str(tmp_path)


def test_the_runtime_folder_beside_torch_is_searched(tmp_path: Path, cuda_torch, monkeypatch) -> None:
    fake_torch = tmp_path / "site-packages" / "torch"
    fake_torch.mkdir(parents=True)
    monkeypatch.setattr(torch, "__file__", str(fake_torch / "__init__.py"))
    write_prebuilt(tmp_path / "site-packages" / prebuilt.RUNTIME_DIR_NAME)
    assert loader.load().WHERE.endswith(prebuilt.RUNTIME_DIR_NAME)


def test_without_a_fit_or_a_toolkit_the_status_says_both(tmp_path: Path, cuda_torch) -> None:
    write_prebuilt(tmp_path, archs=["9.0"])
    loader.configure(prebuilt_dir=tmp_path)
    assert loader.extension() is None
    reason = loader.status()["reason"]
    assert "no CUDA toolkit found" in reason
    assert "no prebuilt extension fits torch" in reason and "sm_89" in reason and "it has sm_90" in reason


def test_an_install_without_ext_matches_prebuilt_modules_by_the_stamp(tmp_path: Path, monkeypatch) -> None:
    """A wheel or the bundle carries no ext/: the sources' hash comes from the stamp its build
    wrote (the same hash the checkout computes), and without either the reason names both."""
    checkout = loader.sources_hash()
    stamp = tmp_path / "SOURCES"
    monkeypatch.setattr(loader, "SOURCES_STAMP", stamp)
    assert loader.write_sources_stamp() == stamp and stamp.read_text().strip() == checkout
    monkeypatch.setattr(loader, "EXT_DIR", tmp_path / "not-installed")
    assert loader.sources_hash() == checkout
    stamp.unlink()
    with pytest.raises(loader.ExtensionUnavailable, match="neither the CUDA extension's sources") as err:
        loader.sources_hash()
    assert str(stamp) in str(err.value)


def test_the_bundle_and_the_wheel_carry_the_stamp() -> None:
    root = Path(__file__).parents[2]
    assert "write_sources_stamp" in (root / "packaging" / "build_bundle.sh").read_text()
    assert "kernels/prebuilt/*" in (root / "pyproject.toml").read_text()  # the stamp's folder
    assert loader.SOURCES_STAMP.parent == prebuilt.PACKAGE_DIR


def test_a_jit_build_is_announced_only_when_it_will_compile(
    tmp_path: Path, cuda_torch, monkeypatch, capsys
) -> None:
    """A first build takes minutes inside whatever asked for a kernel: it says so on stderr; an
    up-to-date build says nothing, a source newer than the module compiles (and says so) again."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(loader, "check_toolchain", lambda: None)
    builds = []

    def fake_build(name: str, build_directory: str, **_) -> object:
        builds.append(build_directory)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return type("Module", (), {"__file__": str(Path(build_directory) / f"{name}.so")})

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    cache = tmp_path / "jit"
    loader.load(cache_dir=cache)
    first = capsys.readouterr().err
    assert "compiling the CUDA extension for sm_89" in first and str(cache) in first
    loader.load(cache_dir=cache)
    assert capsys.readouterr().err == "" and len(builds) == 2  # ninja is still asked; it has nothing to do

    module = Path(builds[0]) / f"{loader.MODULE_NAME}.so"
    source = tmp_path / "kernel.cu"
    source.write_text("")
    made = source.stat().st_mtime
    os.utime(module, (made + 10, made + 10))
    assert not loader.needs_compile(module.parent, [source])
    os.utime(module, (made - 10, made - 10))
    assert loader.needs_compile(module.parent, [source])
    module.unlink()
    assert loader.needs_compile(module.parent, [])
