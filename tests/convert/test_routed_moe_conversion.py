"""The converter on GLM-4.5, MiniMax-M2, Ernie 4.5 MoE and dots.llm1 (the tiny models of
tests/engine/decisive_routers.py): every projection of attention, dense MLPs, routed and shared
experts becomes EXL3 under its checkpoint name; routers and their correction biases (Ernie's
stored as a row) are copied unquantized, and so is Ernie's head bias; the result loads back and
at 8 bits per weight its logits are within 2% of the source's.

The trellis encoder is a stand-in for the Viterbi (quant_helpers.beam_encoder: a 4-beam search,
~0.7-1.4% here; the greedy cheap_encoder's wrap-around error alone is ~13% on GLM's and
MiniMax's logits), and the scale search tries 5 scales on one tile column: ~1 minute per family
on two CPU cores instead of hours."""

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
from decisive_routers import ROUTED_MOE, build_routed_tiny_model  # noqa: E402

IDS = torch.randint(3, 320, (32,), generator=torch.Generator().manual_seed(7)).tolist()

# Per family: (a routed expert's projection, its router, its correction bias) in layer 1.
KEYS = {
    "Glm4MoeForCausalLM": ("mlp.experts.7.gate_proj", "mlp.gate", "mlp.gate.e_score_correction_bias"),
    "MiniMaxM2ForCausalLM": (
        "block_sparse_moe.experts.7.w1",
        "block_sparse_moe.gate",
        "block_sparse_moe.e_score_correction_bias",
    ),
    "Ernie4_5_MoeForCausalLM": (
        "mlp.experts.7.gate_proj",
        "mlp.gate",
        "mlp.moe_statics.e_score_correction_bias",
    ),
    "Dots1ForCausalLM": ("mlp.experts.7.gate_proj", "mlp.gate", "mlp.gate.e_score_correction_bias"),
}


def _logits(directory: Path) -> tuple[torch.Tensor, list[EXL3Linear]]:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(directory, device="cpu", dtype=torch.float32)
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), IDS)
    return logits, [m for m in model.module.modules() if isinstance(m, EXL3Linear)]


def _expected_linears(directory: Path) -> int:
    """q k v o per layer; gate up down of each dense MLP, or of each routed expert and the
    shared expert; and the head."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(directory)
    count = 1
    for layer in architecture_for(cfg.architecture).spec(cfg).layers:
        ff = layer.feed_forward
        experts = ff.num_experts + bool(ff.shared_expert_size) if ff.kind == "sparse_moe" else 1
        count += 4 + 3 * experts
    return count


@pytest.mark.slow
@pytest.mark.convert_quality
@pytest.mark.parametrize("variant", ROUTED_MOE)
def test_8_bit_conversion_keeps_the_logits_within_2_percent(variant, tmp_path, monkeypatch):
    from safetensors import safe_open

    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", beam_encoder)
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    monkeypatch.setattr(quantize_mod, "SCALE_GRID", (0.4, 0.55, 0.7, 0.85, 1.0))
    src, dst = tmp_path / "src", tmp_path / "exl3"
    build_routed_tiny_model(variant, src)
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    source, _ = _logits(src)
    quantized, linears = _logits(dst)
    assert len(linears) == _expected_linears(src)
    err = float((quantized - source).norm() / source.norm())
    print(f"{variant}: 8 bpw logits relative error {err:.4f}")
    assert err < 0.02

    expert, router, bias = (f"model.layers.1.{k}" for k in KEYS[variant])
    storage = json.loads((dst / "quantization_config.json").read_text())["tensor_storage"]
    assert storage[expert]["quant_format"] == "exl3" and storage[expert]["bits_per_weight"] == 8
    assert "quant_format" not in storage[router]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor(f"{router}.weight").shape == (8, 64)
        assert f.get_tensor(bias).numel() == 8
        # no projection left dense (MiniMax-M2's experts are w1/w2/w3)
        assert not [k for k in keys if k.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))]
        if variant.startswith("Ernie"):  # use_bias: the head's bias beside the quantized head
            assert f.get_tensor("lm_head.bias").shape == (320,) and "lm_head.trellis" in keys


@pytest.mark.parametrize("k", [2, 5, 8])
def test_the_beam_stand_in_is_tail_biting_and_close(k):
    """Its states are a valid bitstream (pack -> unpack keeps every one), and their values fit
    the tiles', better than the greedy stand-in's (whose wrap-around the round trip breaks)
    and, at 8 bits, to 1e-4 of their energy: so its two passes meet where the stream wraps."""
    from quant_helpers import cheap_encoder

    from engine.exl3.codebooks import codebook_table
    from engine.exl3.trellis import pack_states, unpack_states

    table = codebook_table("mul1").float()
    # At the scale the converter gives 8-bit tiles (quantize.GAUSSIAN_SCALE): 0.7 codebook std.
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(k)) * table.std() * 0.7

    def rel_mse(states: torch.Tensor) -> float:
        return float(((table[states.long()] - x) ** 2).sum() / (x**2).sum())

    states = beam_encoder(x, k, table)
    assert torch.equal(unpack_states(pack_states(states, k)), states)
    # measured: 0.16, 2.9e-3 and 5.3e-5; the greedy stand-in's 0.41, 0.053 and 6.8e-3
    assert rel_mse(states) < {2: 0.2, 5: 5e-3, 8: 1e-4}[k]
    assert rel_mse(states) < rel_mse(cheap_encoder(x, k, table)) / 2
