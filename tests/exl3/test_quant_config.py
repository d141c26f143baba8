"""quantization_config parsing and tensor_storage cross-checks (docs/EXL3_FORMAT.md section 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quant_helpers import VARIANTS

from engine.errors import ModelLoadError
from engine.exl3.config import (
    check_tensor_storage,
    load_quantization_config,
    parse_quantization_config,
)
from engine.exl3.errors import (
    MissingTensorError,
    QuantFormatError,
    TensorShapeError,
    UnsupportedQuantFormatError,
)

EXPECTED = {
    "4.0bpw-h6-mul1": (4.0, 6, "mul1"),
    "2.5bpw-h4-mcg": (2.5, 4, "mcg"),
    "5.5bpw-h8-3inst": (5.5, 8, "3inst"),
}


def _headers(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_configs(exl3_dir: Path, variant: str) -> None:
    model_dir = exl3_dir / f"tiny-llama-exl3-{variant}"
    cfg = load_quantization_config(model_dir)
    assert cfg is not None
    assert (cfg.bits, cfg.head_bits, cfg.codebook) == EXPECTED[variant]
    assert cfg.version == "1.4.1" and cfg.calibration == {"rows": 250, "cols": 2048}
    assert cfg.head_quantized
    assert cfg.tensor_storage is not None
    q_proj = cfg.tensor_storage["model.layers.0.self_attn.q_proj"]
    assert q_proj.quant_format == "exl3" and q_proj.bits_per_weight is not None
    assert "model.embed_tokens" in cfg.tensor_storage and "model.layers.0" not in cfg.tensor_storage
    # Every listed tensor is in the file with the listed shape.
    check_tensor_storage(cfg, _headers(model_dir / "model.safetensors"))


def test_unquantized_dir_has_no_config(exl3_dir: Path) -> None:
    assert load_quantization_config(exl3_dir / "tiny-llama-hf") is None


def test_missing_and_mismatched_tensors(exl3_dir: Path) -> None:
    model_dir = exl3_dir / "tiny-llama-exl3-2.5bpw-h4-mcg"
    cfg = load_quantization_config(model_dir)
    headers = _headers(model_dir / "model.safetensors")
    missing = dict(headers)
    del missing["model.layers.1.mlp.up_proj.trellis"]
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.trellis"):
        check_tensor_storage(cfg, missing)
    wrong = {**headers, "model.layers.0.self_attn.q_proj.suh": (128,)}
    with pytest.raises(TensorShapeError, match=r"q_proj\.suh"):
        check_tensor_storage(cfg, wrong)


def test_rejects_unsupported(tmp_path: Path) -> None:
    base = {"quant_method": "exl3", "version": "1.4.1", "bits": 4.0, "head_bits": 6}
    with pytest.raises(UnsupportedQuantFormatError, match="gptq"):
        parse_quantization_config({**base, "quant_method": "gptq"})
    with pytest.raises(UnsupportedQuantFormatError, match="2.0.0"):
        parse_quantization_config({**base, "version": "2.0.0"})
    with pytest.raises(UnsupportedQuantFormatError, match="codebook"):
        parse_quantization_config({**base, "codebook": "e8p"})
    with pytest.raises(QuantFormatError, match="head_bits"):
        parse_quantization_config({**base, "head_bits": 12})
    # Old converters: no calibration/out_scales/codebook, pre-release version strings.
    old = parse_quantization_config({**base, "version": "0.0.9.dev1"})
    assert old.codebook is None and old.calibration is None
    assert not parse_quantization_config({**base, "head_bits": 16}).head_quantized
    # Errors are ModelLoadErrors and name the file.
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**base, "version": "3.1"}}))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_quantization_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(QuantFormatError, match="config.json"):
        load_quantization_config(tmp_path)


def test_quantization_config_json_alone(tmp_path: Path, exl3_dir: Path) -> None:
    # A directory whose config.json lacks the object still loads from quantization_config.json.
    src = exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1" / "quantization_config.json"
    (tmp_path / "quantization_config.json").write_text(src.read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = load_quantization_config(tmp_path)
    assert cfg is not None and cfg.codebook == "mul1" and cfg.tensor_storage
