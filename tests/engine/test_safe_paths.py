"""``engine.safe_paths.safe_join`` and the readers that take file names from a model's own files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.safe_paths import UnsafePathError, path_problem, safe_join

BAD = {
    "../../x": "'..' path component",
    "a/../../b": "'..' path component",
    "..": "'..' path component",
    "./a": "'.' path component",
    "/abs/path": "absolute",
    "//server/share": "absolute",
    "C:\\x": "backslash",
    "C:x": "colon",
    "model.bin:stream": "colon",
    "a\\..\\b": "backslash",
    "a\x00b": "control character",
    "a\nb": "control character",
    "a\x85b": "control character",  # C1 "next line"
    "a//b": "empty path component",
    "a/": "empty path component",
    "": "empty",
}


@pytest.mark.parametrize("name", list(BAD), ids=repr)
def test_bad_names_are_refused_naming_the_path(tmp_path, name):
    with pytest.raises(UnsafePathError) as info:
        safe_join(tmp_path, name)
    assert repr(name) in str(info.value)
    assert BAD[name] in str(info.value)
    assert info.value.name == name
    assert path_problem(name) is not None


def test_non_strings_are_refused(tmp_path):
    with pytest.raises(UnsafePathError):
        safe_join(tmp_path, None)  # type: ignore[arg-type]
    assert path_problem(b"a") is not None


@pytest.mark.parametrize("name", ["file.bin", "sub/dir/file.bin", "a..b/.hidden", "x y/ünï.txt"])
def test_plain_relative_names_join_under_the_root(tmp_path, name):
    assert path_problem(name) is None
    assert safe_join(tmp_path, name) == tmp_path.joinpath(*name.split("/"))
    assert safe_join(tmp_path, name, suffix=".part") == tmp_path.joinpath(*name.split("/")).with_name(
        name.split("/")[-1] + ".part"
    )


def test_a_symlink_inside_the_root_cannot_lead_out(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "inner").mkdir()
    (root / "ok").symlink_to(root / "inner", target_is_directory=True)
    with pytest.raises(UnsafePathError, match="leads outside"):
        safe_join(root, "link/file.bin")
    assert safe_join(root, "ok/file.bin") == root / "ok" / "file.bin"  # a link that stays inside
    # Readers of folders the user linked together (a HF cache snapshot) check the names only.
    assert safe_join(root, "link/file.bin", resolve=False) == root / "link" / "file.bin"
    with pytest.raises(UnsafePathError):
        safe_join(root, "../outside/file.bin", resolve=False)


def test_a_root_reached_through_a_symlink_is_fine(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    assert safe_join(tmp_path / "alias", "a/b") == tmp_path / "alias" / "a" / "b"


def _safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F16", "shape": [8, 8], "data_offsets": [0, 128]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(128))


def _model_with_index(tmp_path: Path, shard: str) -> Path:
    model = tmp_path / "lib" / "model"
    model.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
    }
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    _safetensors(tmp_path / "lib" / "outside.safetensors")  # a real file the index points at
    return model


def test_weight_store_refuses_an_index_pointing_outside(tmp_path):
    from engine.loading.safetensors_store import WeightStore

    model = _model_with_index(tmp_path, "../outside.safetensors")
    with pytest.raises(ModelLoadError, match=r"outside the model folder.*'\.\./outside\.safetensors'"):
        WeightStore(model)


def test_weight_store_still_reads_shards_in_subfolders(tmp_path):
    from engine.loading.safetensors_store import WeightStore

    model = _model_with_index(tmp_path, "shards/part-1.safetensors")
    (model / "shards").mkdir()
    _safetensors(model / "shards" / "part-1.safetensors")
    assert WeightStore(model).keys() == {"w"}


def test_inspect_reports_an_index_pointing_outside_and_ignores_it(tmp_path):
    from engine.inspect import inspect_model

    model = _model_with_index(tmp_path, "../outside.safetensors")
    info = inspect_model(model)
    assert any("outside the model folder" in p and "../outside.safetensors" in p for p in info.problems)
    assert not info.ok
    assert not info.parameter_count and info.weight_bytes == 0  # the outside file was not counted
