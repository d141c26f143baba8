"""MXFP4 tensors (gpt-oss's experts on the Hub): read dequantized, to the bit as transformers
dequantizes them, by the weight store (so by the model builder and the converter alike)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_gpt_oss import build_tiny_gpt_oss, dequantize_reference, quantize_mxfp4

from engine.cache.paged import PagedKVCache
from engine.generation.step import score_tokens
from engine.loading import mxfp4
from engine.loading.safetensors_store import WeightStore
from engine.model import load_model

EXPERTS = "model.layers.1.mlp.experts."


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_transformers_bit_for_bit(dtype) -> None:
    """Every code in every nibble, every scale E8M0 can hold but its NaN (255): the two
    dequantizations agree on every bit, infinities and signed zeros included."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles through all 16 codes
    scales = torch.randint(0, 255, (3, 64, 4), generator=g, dtype=torch.uint8)
    scales[0, :2, 0] = torch.tensor([0, 254], dtype=torch.uint8)  # the extremes
    got = mxfp4.dequantize(blocks, scales, dtype)
    want = dequantize_reference(blocks, scales, dtype)
    assert got.shape == want.shape == (3, 128, 64) and got.dtype == want.dtype == dtype
    assert torch.equal(_bits(got), _bits(want))
    assert mxfp4.dequantized_shape(blocks.shape) == [3, 128, 64]


def test_the_test_encoder_round_trips_e2m1_values() -> None:
    """The test-side encoder (tiny_gpt_oss.quantize_mxfp4) keeps values already on the MXFP4 grid."""
    w = dequantize_reference(*quantize_mxfp4(torch.randn(2, 64, 8)))
    assert torch.equal(dequantize_reference(*quantize_mxfp4(w)), w)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return directory, build_tiny_gpt_oss(directory, mxfp4=True)


def test_the_store_lists_and_reads_an_mxfp4_pair_as_one_tensor(mxfp4_model) -> None:
    directory, reference = mxfp4_model
    store = WeightStore(directory)
    assert store.has(EXPERTS + "gate_up_proj") and store.has(EXPERTS + "down_proj_bias")
    assert not any(k.endswith(("_blocks", "_scales")) for k in store.keys())
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        blocks, scales = (
            f.get_tensor(EXPERTS + "gate_up_proj_blocks"),
            f.get_tensor(EXPERTS + "gate_up_proj_scales"),
        )
    assert blocks.dtype == torch.uint8 and list(blocks.shape) == [
        4,
        64,
        2,
        16,
    ]  # [experts, 2f, hidden/32, 16]
    assert store.shape(EXPERTS + "gate_up_proj") == [4, 64, 64]
    meta = store.meta(EXPERTS + "down_proj")
    assert meta.shape == (4, 32, 64) and meta.dtype == torch.bfloat16
    plain = store.get(EXPERTS + "gate_up_proj")
    assert plain.dtype == torch.bfloat16
    assert torch.equal(_bits(plain), _bits(dequantize_reference(blocks, scales, torch.bfloat16)))
    wide = store.get(EXPERTS + "gate_up_proj", dtype=torch.float32, shape=[4, 64, 64])
    assert torch.equal(_bits(wide), _bits(dequantize_reference(blocks, scales, torch.float32)))
    assert torch.equal(wide, reference.model.layers[1].mlp.experts.gate_up_proj)
    assert (
        json.loads((directory / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    )


def test_an_mxfp4_checkpoint_matches_transformers(mxfp4_model) -> None:
    """The model loaded from the MXFP4 checkpoint scores as transformers' model with the same
    (dequantized) experts."""
    directory, reference = mxfp4_model
    model = load_model(directory, device="cpu")
    ids = torch.randint(3, 320, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    got = score_tokens(model.module, PagedKVCache.for_model(model.spec, 128, page_size=16), ids, chunk=20)
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-4


def test_the_inspector_takes_an_mxfp4_checkpoint_as_loadable(mxfp4_model) -> None:
    """The model library's inspector names the format and finds nothing against it (any other
    quantization but EXL3 is still a problem)."""
    from engine.inspect import inspect_model

    directory, _ = mxfp4_model
    info = inspect_model(directory)
    assert info.quantization == "MXFP4"
    assert not [p for p in info.problems if "quantization" in p]  # (the tiny model has no tokenizer)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (directory / "config.json").write_text(json.dumps(config))
    try:
        assert any("'gptq' is not supported" in p for p in inspect_model(directory).problems)
    finally:
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (directory / "config.json").write_text(json.dumps(config))
