"""Lock files of the GPU runtime (the one shipped, malformed ones), the choice of variant by
driver, and the lock generator's offline parts."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from app.runtime.lock import LOCKS_DIR, LockError, parse_lock, read_lock, shipped_locks
from app.runtime.variant import choose

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "make_runtime_lock", ROOT / "packaging" / "make_runtime_lock.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_cu130_lock_fits_the_bundle() -> None:
    lock = read_lock(LOCKS_DIR / "runtime-cu130.lock.json")
    assert (lock.variant, lock.torch, lock.cuda, lock.python) == ("cu130", "2.13.0", "13.0", "cp311")
    names = {w.name for w in lock.wheels}
    assert {"torch", "nvidia-cublas", "nvidia-cudnn-cu13", "triton"} <= names
    assert 2.0 * 2**30 < lock.download_size < 3.5 * 2**30  # the "2.6 GB" the dialog says
    for wheel in lock.wheels:
        # Built for CPython 3.11 (or pure Python) and a glibc no newer than the bundle's baseline.
        assert re.search(r"-(cp311-cp311|py3-none|py2\.py3-none)-", wheel.filename), wheel.filename
        glibc = [int(m) for m in re.findall(r"manylinux_2_(\d+)", wheel.filename)]
        assert not glibc or min(glibc) <= 28, wheel.filename
        assert wheel.url.startswith("https://files.pythonhosted.org/") and wheel.url.endswith(wheel.filename)
        assert wheel.unpacked_size and wheel.unpacked_size >= wheel.size * 0.9


def good_lock_json() -> dict:
    return json.loads((LOCKS_DIR / "runtime-cu130.lock.json").read_text())


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda d: d.update(format=2), "format 2"),
        (lambda d: d["wheels"][0].update(sha256="abc"), "sha256 is not 64 hex digits"),
        (lambda d: d["wheels"][0].update(filename="../x.whl"), "not a plain, unique file name"),
        (lambda d: d["wheels"][1].update(filename=d["wheels"][0]["filename"]), "unique"),
        (lambda d: d["wheels"][0].update(size=-1), "positive"),
        (lambda d: d["wheels"][0].update(url="file:///etc/passwd"), "not an http(s) URL"),
        (lambda d: d.update(wheels=[]), "lists no wheels"),
        (lambda d: d.pop("torch"), "'torch' is missing"),
        (lambda d: d.update(min_driver_cuda="new"), "not a version"),
    ],
)
def test_a_malformed_lock_is_refused_naming_the_field(damage, says) -> None:
    data = good_lock_json()
    damage(data)
    with pytest.raises(LockError, match=re.escape(says)):
        parse_lock(data, "runtime-x.lock.json")


def test_shipped_locks_come_newest_cuda_first(tmp_path: Path) -> None:
    base = parse_lock(good_lock_json())
    for variant, cuda in (("cu126", "12.6"), ("cu130", "13.0"), ("cu128", "12.8")):
        lock = replace(base, variant=variant, cuda=cuda, min_driver_cuda=cuda)
        (tmp_path / f"runtime-{variant}.lock.json").write_text(json.dumps(lock.to_json()))
    assert [lock.variant for lock in shipped_locks(tmp_path)] == ["cu130", "cu128", "cu126"]


@pytest.fixture
def three_locks() -> list:
    base = parse_lock(good_lock_json())
    return [
        replace(base, variant=v, cuda=c, min_driver_cuda=c)
        for v, c in (("cu126", "12.6"), ("cu128", "12.8"), ("cu130", "13.0"))
    ]


@pytest.mark.parametrize(
    "driver_cuda, variant",
    [
        ("13.1", "cu130"),
        ("13.0", "cu130"),
        ("12.9", "cu128"),
        ("12.8", "cu128"),
        ("12.6", "cu126"),
        ("12.7", "cu126"),
    ],
)
def test_the_newest_cuda_the_driver_supports_is_chosen(three_locks, driver_cuda, variant) -> None:
    choice = choose(three_locks, driver_cuda, python="cp311")
    assert choice.lock is not None and choice.lock.variant == variant
    assert driver_cuda in choice.reason


def test_no_runtime_for_an_old_driver_or_another_python(three_locks) -> None:
    old = choose(three_locks, "12.4", python="cp311")
    assert old.lock is None and "Update the NVIDIA driver" in old.reason and "12.6" in old.reason
    assert choose(three_locks, None, python="cp311").lock is None
    other = choose(three_locks, "13.0", python="cp312")
    assert other.lock is None and "cp312" in other.reason


def test_generator_lists_every_manylinux_tag_up_to_the_baseline() -> None:
    tags = load_generator().platform_tags("2.28")
    assert (
        tags[0] == "manylinux_2_28_x86_64"
        and "manylinux_2_17_x86_64" in tags
        and "manylinux_2_5_x86_64" in tags
    )
    assert "manylinux2014_x86_64" in tags and "manylinux_2_29_x86_64" not in tags


def test_generator_turns_a_pip_report_entry_into_a_locked_wheel(monkeypatch) -> None:
    gen = load_generator()
    monkeypatch.setattr(gen, "remote_size", lambda url: 1234)
    monkeypatch.setattr(gen, "unpacked_size", lambda url, size: 5678)
    entry = {
        "metadata": {"name": "torch", "version": "2.13.0+cu128"},
        "download_info": {
            "url": "https://download.pytorch.org/whl/cu128/torch-2.13.0%2Bcu128-cp311-cp311-manylinux_2_28_x86_64.whl",
            "archive_info": {"hashes": {"sha256": "a" * 64}},
        },
    }
    wheel = gen.wheel_from_report(entry)
    assert wheel.filename == "torch-2.13.0+cu128-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert (wheel.size, wheel.unpacked_size, wheel.sha256) == (1234, 5678, "a" * 64)
    entry["download_info"]["archive_info"] = {}
    with pytest.raises(SystemExit, match="sha256"):
        gen.wheel_from_report(entry)


def test_the_wheel_carries_the_lock_files_and_the_prebuilt_folder() -> None:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "runtime/locks/*" in data["app"] and "kernels/prebuilt/*" in data["engine"]
