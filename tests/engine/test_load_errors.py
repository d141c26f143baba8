"""Bad model directories fail with errors that name the problem and the file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.model import load_model


@pytest.fixture
def model_copy(tiny_model_copy):
    return tiny_model_copy("LlamaForCausalLM")


def shard(directory):
    """Re-save the model as two shards with an index, as large checkpoints are stored."""
    from safetensors.torch import load_file

    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    parts = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, directory / file)
        weight_map.update({k: file for k in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_loads_like_single(model_copy, tiny_model_factory):
    directory, _ = tiny_model_factory("LlamaForCausalLM")
    single = load_model(directory, device="cpu")
    shard(model_copy)
    sharded = load_model(model_copy, device="cpu")
    for a, b in zip(single.module.parameters(), sharded.module.parameters()):
        assert torch.equal(a, b)


def test_missing_shard_is_named(model_copy):
    shard(model_copy)
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors.*missing"):
        load_model(model_copy, device="cpu")


def test_corrupt_header_is_named(model_copy):
    path = model_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\x00garbage!!!\x00"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.safetensors has a corrupt safetensors header"):
        load_model(model_copy, device="cpu")


def test_truncated_weights_are_named(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="is truncated"):
        load_model(model_copy, device="cpu")


def test_unknown_architecture_is_named(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedArchitectureError, match="FancyNewForCausalLM.*supports: .*LlamaForCausalLM"
    ):
        load_model(model_copy, device="cpu")


def test_missing_tensor_is_named(model_copy):
    from safetensors.torch import load_file

    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="'model.layers.1.mlp.down_proj.weight' is missing"):
        load_model(model_copy, device="cpu")


def test_wrong_shape_is_named(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"has shape \[128, 64\], expected \[100, 64\]"):
        load_model(model_copy, device="cpu")


def test_missing_config_is_named(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(model_copy, device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(tiny_model_factory, tmp_path, dtype):
    from tiny_models import build_tiny_model

    ref = build_tiny_model("Qwen2ForCausalLM", tmp_path / "m", dtype=dtype)
    model = load_model(tmp_path / "m", device="cpu", dtype=dtype)
    ids = torch.arange(3, 40)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0].float()
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens

    got = score_tokens(
        model.module, PagedKVCache.for_model(model.spec, 64, page_size=16, dtype=dtype), ids.tolist()
    )
    # Half precision: same maths, different kernels; agreement to a few bf16/fp16 ulps.
    assert ((got - expected).norm() / expected.norm()).item() < 2e-2
