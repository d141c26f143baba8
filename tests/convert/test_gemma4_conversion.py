"""The converter on Gemma 4's E2B layout (tests/engine/tiny_gemma4.py, settled as a trained model
is): per-layer inputs made from the calibration tokens, layers that read an earlier layer's keys
and values (carried through the converter with the stream: engine.convert.carried) and MLPs twice
as wide there. Every projection becomes EXL3 under its checkpoint name (the readers' q and o
only), the per-layer inputs' tables and the layer scalars are copied, the result loads back and
at 8 bits per weight its logits are within 2% of the source's.

The trellis encoder is the beam stand-in for the Viterbi (quant_helpers.beam_encoder) and the
scale search tries 5 scales on one tile column, as in test_routed_moe_conversion.py: ~40 s on a
CPU core."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from quant_helpers import beam_encoder, tiny_convert_options

import engine.convert.quantize as quantize_mod
from engine.exl3 import EXL3Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_gemma4 import build_tiny_gemma4  # noqa: E402

IDS = torch.randint(3, 320, (64,), generator=torch.Generator().manual_seed(7)).tolist()


def _logits(directory: Path) -> tuple[torch.Tensor, list[EXL3Linear]]:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(directory, device="cpu", dtype=torch.float32)
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 128, page_size=16), IDS)
    return logits, [m for m in model.module.modules() if isinstance(m, EXL3Linear)]


def test_the_carried_state_holds_the_stream_then_the_layers_extra_inputs():
    from engine.convert.carried import SCALE, carry_layout

    assert 2**24 * SCALE == 1.0  # exactly a power of two: carried numbers round-trip unchanged
    with_inputs = carry_layout(_spec("e2b"))
    # 64 stream, 64 embeddings, 1 token; then layer 1's keys and values (2 x 16 each), layer 2's
    # (2 x 32 each): the layers the last three read.
    assert (with_inputs.hidden, with_inputs.per_layer_inputs, with_inputs.token_column) == (64, True, 128)
    assert with_inputs.kv == {1: (129, 2, 16), 2: (193, 2, 32)} and with_inputs.width == 321
    assert carry_layout(_spec("31b")) is None  # its blocks read the stream alone


def _spec(layout: str):
    import tempfile

    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        build_tiny_gemma4(layout, directory)
        return architecture_for("Gemma4ForCausalLM").spec(ModelConfig.from_dir(directory))


@pytest.mark.slow
def test_8_bit_conversion_of_the_e2b_layout_keeps_the_logits_within_2_percent(tmp_path, monkeypatch):
    from safetensors import safe_open

    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", beam_encoder)
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    monkeypatch.setattr(quantize_mod, "SCALE_GRID", (0.4, 0.55, 0.7, 0.85, 1.0))
    src, dst = tmp_path / "src", tmp_path / "exl3"
    build_tiny_gemma4("e2b", src, settled=True)
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    source, _ = _logits(src)
    quantized, linears = _logits(dst)
    # layers 0-2: q k v o, gate up down, the per-layer gate and projection; 3-5: q o and the
    # rest; the head
    assert len(linears) == 3 * 9 + 3 * 7 + 1
    err = float((quantized - source).norm() / source.norm())
    print(f"gemma4 e2b: 8 bpw logits relative error {err:.4f}")
    assert err < 0.02

    storage = json.loads((dst / "quantization_config.json").read_text())["tensor_storage"]
    for key in (
        "model.layers.3.self_attn.q_proj",
        "model.layers.0.per_layer_input_gate",
        "model.layers.4.mlp.down_proj",
    ):
        assert storage[key]["quant_format"] == "exl3" and storage[key]["bits_per_weight"] == 8
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens_per_layer.weight").shape == (320, 6 * 8)
        assert f.get_tensor("model.per_layer_model_projection.weight").dtype == torch.float16
        assert f.get_tensor("model.layers.5.layer_scalar").shape == (1,)
    assert not any(k.startswith("model.layers.3.self_attn.k_proj") for k in keys)  # a reader
