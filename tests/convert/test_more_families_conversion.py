"""MiMo, IQuest-Coder, HyperCLOVA X, nanochat, Solar Open and DeciLM in EXL3 (tiny checkpoints of
tests/engine/tiny_more_families.py).

- ``engine convert`` at 8 bits per weight: every linear quantized under its checkpoint name, and
  the logits within 2% of the unquantized model's. The trellis encoder is the beam stand-in for
  the Viterbi (quant_helpers.beam_encoder) with a short scale search, as in
  test_gemma4_conversion.py.
- A checkpoint in ExLlamaV3's layout loads: the linears ExLlamaV3's architecture file for the
  family quantizes, under its key names (per expert for Solar Open's experts, which transformers
  saves fused), are EXL3 and every one of them is read as such (tests/support/exl3_layout.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from exl3_layout import write_exl3_model
from quant_helpers import beam_encoder, tiny_convert_options

import engine.convert.quantize as quantize_mod
from engine.exl3 import EXL3Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_more_families import BUILDERS, build_deci, deci_mlp_width  # noqa: E402

FAMILIES = [*BUILDERS, "DeciLMForCausalLM"]
IDS = torch.randint(3, 320, (64,), generator=torch.Generator().manual_seed(7)).tolist()


def _build(family: str, directory: Path) -> None:
    if family == "DeciLMForCausalLM":
        build_deci(directory)
    else:
        BUILDERS[family](directory)


def _logits(directory: Path) -> tuple[torch.Tensor, list[EXL3Linear]]:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(directory, device="cpu", dtype=torch.float32)
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 128, page_size=16), IDS)
    return logits, [m for m in model.module.modules() if isinstance(m, EXL3Linear)]


def exllamav3_linears(config: dict) -> dict[str, tuple[int, int]]:
    """``key -> (in, out)`` of every linear ExLlamaV3 quantizes in a model of ``config``, under
    its names: q/k/v/o and the MLP's (nanochat's fc1/fc2; Solar Open's experts one by one and
    its shared expert), skipping DeciLM's no-op sub-layers; and the head."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    arch = config["architectures"][0]
    out: dict[str, tuple[int, int]] = {"lm_head": (h, config["vocab_size"])}
    blocks = config.get("block_configs") or [{}] * config["num_hidden_layers"]
    for i, block in enumerate(blocks):
        p = f"model.layers.{i}."
        attention, ffn = block.get("attention", {}), block.get("ffn", {})
        if not attention.get("no_op"):
            group = attention.get("n_heads_in_group")
            kv = heads // group if group else config["num_key_value_heads"]
            out |= {p + "self_attn.q_proj": (h, heads * d), p + "self_attn.o_proj": (heads * d, h)}
            out |= {p + "self_attn.k_proj": (h, kv * d), p + "self_attn.v_proj": (h, kv * d)}
        if ffn.get("no_op"):
            continue
        if arch == "NanoChatForCausalLM":
            f = config["intermediate_size"]
            out |= {p + "mlp.fc1": (h, f), p + "mlp.fc2": (f, h)}
            continue
        if arch == "SolarOpenForCausalLM":
            f = config["moe_intermediate_size"]
            mlps = [f"mlp.experts.{e}." for e in range(config["n_routed_experts"])] + ["mlp.shared_experts."]
        else:
            f = deci_mlp_width(ffn["ffn_mult"], h) if "ffn_mult" in ffn else config["intermediate_size"]
            mlps = ["mlp."]
        for m in mlps:
            out |= {p + m + "gate_proj": (h, f), p + m + "up_proj": (h, f), p + m + "down_proj": (f, h)}
    return out


# Solar Open's 27 experts and DeciLM's wide MLPs take 30-50 s on a CPU core: with the quality runs.
SLOW = ("SolarOpenForCausalLM", "DeciLMForCausalLM")


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.convert_quality) if f in SLOW else f for f in FAMILIES]
)
def test_8_bit_conversion_keeps_the_logits_within_2_percent(family, tmp_path, monkeypatch):
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", beam_encoder)
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    monkeypatch.setattr(quantize_mod, "SCALE_GRID", (0.4, 0.55, 0.7, 0.85, 1.0))
    src, dst = tmp_path / "src", tmp_path / "exl3"
    _build(family, src)
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    source, _ = _logits(src)
    quantized, linears = _logits(dst)
    expected = exllamav3_linears(json.loads((src / "config.json").read_text()))
    assert {m.key for m in linears} == set(expected)  # every linear, under ExLlamaV3's names
    err = float((quantized - source).norm() / source.norm())
    print(f"{family}: 8 bpw logits relative error {err:.4f}")
    assert err < 0.02


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_in_exllamav3_layout_loads(family, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "exl3"
    _build(family, src)
    config = json.loads((src / "config.json").read_text())
    linears = exllamav3_linears(config)
    # transformers 5 saves Solar Open's experts fused; ExLlamaV3 stores them one by one
    write_exl3_model(src, dst, linears, bits=4, drop=_fused(config))
    logits, loaded = _logits(dst)
    assert {m.key for m in loaded} == set(linears) and {m.bits for m in loaded} == {4}
    assert logits.shape == (len(IDS), 320) and torch.isfinite(logits).all()


def _fused(config: dict) -> tuple[str, ...]:
    if config["architectures"][0] != "SolarOpenForCausalLM":
        return ()
    layers = range(config["num_hidden_layers"])
    return tuple(
        f"model.layers.{i}.mlp.experts.{name}" for i in layers for name in ("gate_up_proj", "down_proj")
    )
