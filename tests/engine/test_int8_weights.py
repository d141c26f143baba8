"""Int8 matrices with row scales (engine.loading.int8, engine.modules.int8): the quantizer, the
linear and embedding against float32 maths, a tiny model written in the format and loaded back,
and the errors for corrupt scales and unsupported settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cache.paged import PagedKVCache
from engine.errors import ModelLoadError
from engine.generation.step import score_tokens
from engine.inspect import inspect_model
from engine.loading import int8
from engine.loading.safetensors_store import WeightStore
from engine.model import load_model
from engine.modules import int8 as int8_modules
from engine.modules.int8 import Int8Embedding, Int8Linear

IDS = [5, 17, 200, 42, 9, 100, 77, 3, 250, 1]


def _float_rows(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    w = g.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[1] *= 40  # a row with a much larger range than the others keeps its own scale
    w[2] = 0.0  # an all-zero row
    return w


def test_quantize_rows_picks_bfloat16_scales_and_rounds_to_nearest():
    w = _float_rows(8, 96)
    codes, scale = int8.quantize_rows(w)
    assert codes.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (8,)
    assert np.abs(codes).max() <= 127 and (codes == 0).all(axis=1)[2] and scale[2] == 0
    t = torch.from_numpy(scale)
    assert torch.equal(t.to(torch.bfloat16).float(), t)  # exact in bfloat16
    assert (t >= torch.from_numpy(np.abs(w).max(axis=1) / 127)).all()  # rounded up: no clipping
    error = np.abs(codes * scale[:, None] - w)
    assert (error <= scale[:, None] / 2 + 1e-9).all()


def _pair(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scale = int8.quantize_rows(_float_rows(rows, cols, seed))
    codes, scale = torch.from_numpy(codes), torch.from_numpy(scale)
    return codes, scale, codes.float() * scale[:, None]


@pytest.mark.parametrize("cols", [128, 96])  # the kernel's widths, and one it cannot take
def test_int8_linear_computes_the_dequantized_product(cols):
    codes, scale, dense = _pair(40, cols)
    bias = torch.randn(40)
    linear = Int8Linear(codes, scale, bias)
    x = torch.randn(2, 7, cols)
    expected = x @ dense.T + bias
    got = linear(x)
    assert got.shape == (2, 7, 40) and got.dtype == torch.float32
    # bfloat16 activations in the kernel: about 3 significant digits.
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    assert torch.equal(linear.dequantized(torch.float32), dense)


def test_int8_linear_rows_do_not_depend_on_their_batch():
    codes, scale, _ = _pair(64, 128)
    linear = Int8Linear(codes, scale)
    x = torch.randn(33, 128)
    together = linear(x)
    for rows in (x[:1], x[5:9], x[:17]):
        alone = linear(rows)
        first = next(i for i in range(len(x)) if torch.equal(x[i], rows[0]))
        assert torch.equal(alone, together[first : first + len(rows)])


def test_misaligned_codes_and_activations_are_copied_before_the_kernel():
    # Codes memory-mapped from a file and activations that are views can start at any byte; the
    # kernel's aligned vector loads would crash the process on them.
    codes, scale, dense = _pair(64, 128)
    storage = torch.zeros(codes.numel() + 8, dtype=torch.int8)
    shifted = storage[8:].view(64, 128)
    shifted.copy_(codes)
    linear = Int8Linear(shifted, scale)
    assert linear.codes.data_ptr() % int8_modules.ALIGNMENT == 0
    x = torch.randn(5 * 128 + 3, dtype=torch.bfloat16)[3:].view(5, 128)
    expected = x.float() @ dense.T
    got = linear(x).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2 * expected.abs().max().item())


def test_fallback_without_the_kernel_is_exact_float32(monkeypatch):
    codes, scale, dense = _pair(40, 128)
    monkeypatch.setattr(int8_modules, "_kernel", lambda: None)
    monkeypatch.setattr(int8_modules, "_FALLBACK_ROWS", 16)  # several blocks of rows
    x = torch.randn(5, 128)
    torch.testing.assert_close(Int8Linear(codes, scale)(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_the_kernel_is_checked_before_use():
    kernel = int8_modules._kernel()
    if kernel is None:
        pytest.skip("this torch has no usable _weight_int8pack_mm: the fallback runs")
    assert kernel is torch.ops.aten._weight_int8pack_mm


def test_int8_embedding_rows_and_tied_head():
    codes, scale, dense = _pair(50, 64)
    embedding = Int8Embedding(codes, scale, torch.float32)
    ids = torch.tensor([[3, 1, 2], [49, 0, 3]])
    assert torch.equal(embedding(ids), dense[ids])
    assert Int8Embedding(codes, scale, torch.bfloat16)(ids).dtype == torch.bfloat16
    head = embedding.head()
    assert head.codes is embedding.weight and head.scale is embedding.scale  # stored once
    x = torch.randn(4, 64)
    torch.testing.assert_close(head(x), x @ dense.T, rtol=0, atol=2e-2 * (x @ dense.T).abs().max().item())


def test_mismatched_codes_and_scales_are_refused():
    codes, scale, _ = _pair(8, 64)
    with pytest.raises(ValueError, match="scales"):
        Int8Linear(codes, scale[:7])
    with pytest.raises(ValueError, match="int8 codes"):
        Int8Embedding(codes.float(), scale, torch.float32)


# ---------------------------------------------------------------------------------------------
# A tiny model in the format
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_float32(tmp_path_factory) -> Path:
    """A random tiny Llama (tied embeddings) saved by transformers in float32."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,  # down_proj's input width is no multiple of 64: the fallback runs it
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("tiny") / "float32"
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def write_int8(src: Path, dst: Path) -> Path:
    """``src`` (float safetensors) in the int8 format: every matrix quantized, the rest as is."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if t.dim() == 2 and min(t.shape) > 1 and name.endswith(".weight"):
            codes, scale = int8.quantize_rows(t.float().numpy())
            tensors[name], tensors[name + int8.SCALE_SUFFIX] = (
                torch.from_numpy(codes),
                torch.from_numpy(scale),
            )
        else:
            tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = int8.quantization_config()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def tiny_int8(tiny_float32, tmp_path_factory) -> Path:
    return write_int8(tiny_float32, tmp_path_factory.mktemp("tiny") / "int8")


def _logits(directory: Path, **kwargs) -> torch.Tensor:
    model = load_model(directory, device="cpu", **kwargs)
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16, dtype=model.dtype)
    return score_tokens(model.module, cache, IDS)


def test_round_trip_gives_the_float32_models_logits(tiny_float32, tiny_int8):
    model = load_model(tiny_int8, device="cpu")
    module = model.module
    assert isinstance(module.embedding, Int8Embedding) and module.dtype == torch.float32
    assert isinstance(module.lm_head, Int8Linear) and module.lm_head.codes is module.embedding.weight
    linears = [m for m in module.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, and the tied head
    reference = load_model(tiny_float32, device="cpu")
    assert model.parameter_bytes() < 0.3 * reference.parameter_bytes()
    expected, got = _logits(tiny_float32), _logits(tiny_int8)
    assert got.shape == expected.shape
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 0.02
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_bfloat16_compute_loads_too(tiny_int8):
    model = load_model(tiny_int8, device="cpu", dtype="bfloat16")
    assert model.module.dtype == torch.bfloat16
    logits = _logits(tiny_int8, dtype="bfloat16")
    assert torch.isfinite(logits).all()


def test_the_store_reads_int8_matrices_dequantized(tiny_int8):
    store = WeightStore(tiny_int8)
    key = "model.layers.0.mlp.up_proj.weight"
    assert store.is_int8(key) and not store.is_int8("model.norm.weight")
    assert not any(k.endswith(int8.SCALE_SUFFIX) for k in store.keys())  # scales are not listed
    codes, scale = store.int8_matrix(key)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(store.get(key), codes.float() * scale[:, None])
    assert store.get(key, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert store.meta(key).dtype == torch.float32 and list(store.meta(key).shape) == list(codes.shape)


def test_inspect_reports_int8(tiny_int8):
    info = inspect_model(tiny_int8)
    assert info.quantization == "INT8" and info.bits_per_weight == 8.0
    assert not [p for p in info.problems if "quantiz" in p]  # (the tiny model has no tokenizer)
    stored = load_file(tiny_int8 / "model.safetensors")
    parameters = sum(t.numel() for k, t in stored.items() if not k.endswith(int8.SCALE_SUFFIX))
    assert info.parameter_count == parameters  # the scales are not counted


def _corrupt(src: Path, dst: Path, key: str, value: torch.Tensor | None) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if value is None:
        del tensors[key]
    else:
        tensors[key] = value
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


SCALE = "model.layers.1.self_attn.q_proj.weight_scale"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.ones(63), r"shape is \[63\], expected \[64\]"),
        (torch.ones(64, 1), r"shape is \[64, 1\]"),
        (torch.full((64,), float("nan")), "negative, infinite or NaN"),
        (-torch.ones(64), "negative, infinite or NaN"),
        (torch.ones(64, dtype=torch.int32), "dtype is int32"),
    ],
)
def test_a_corrupt_scale_tensor_is_named(tiny_int8, tmp_path, value, message):
    bad = _corrupt(tiny_int8, tmp_path / "bad", SCALE, value)
    with pytest.raises(ModelLoadError, match=f"corrupt scale tensor '{SCALE}'.*{message}"):
        load_model(bad, device="cpu")


def test_int8_codes_without_scales_are_refused(tiny_int8, tmp_path):
    bad = _corrupt(tiny_int8, tmp_path / "bad", SCALE, None)
    with pytest.raises(ModelLoadError, match="is int8 but its scale tensor .* is missing"):
        load_model(bad, device="cpu")


@pytest.mark.parametrize("field", [{"group_size": 32}, {"bits": 4}, {"symmetric": False}])
def test_unsupported_int8_settings_are_refused(tiny_int8, tmp_path, field):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_int8, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(field)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="int8 quantization with .* is not supported"):
        load_model(bad, device="cpu")


@pytest.mark.cuda
def test_a_gpu_dequantizes_at_load(tiny_int8):
    model = load_model(tiny_int8, device="cuda", dtype="bfloat16")
    assert not any(isinstance(m, (Int8Linear, Int8Embedding)) for m in model.module.modules())
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16, dtype=model.dtype, device="cuda")
    got = score_tokens(model.module, cache, IDS).float().cpu()
    expected = _logits(tiny_int8)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 0.05
