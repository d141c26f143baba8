"""The converter on DeepSeek-V3 (the tiny models of tests/engine/tiny_deepseek.py): every projection of
the latent attention (the query LoRA's two, or the plain q_proj; kv_a_proj_with_mqa, kv_b_proj,
o_proj), of the dense MLPs and of the routed and shared experts becomes EXL3 under its checkpoint
name; the low-rank norms, the routers and their correction biases are copied unquantized; the result
loads back, its decode steps absorb the quantized kv_b_proj, and at 8 bits per weight its logits are
within 2% of the source's.

The trellis encoder is a beam-search stand-in for the Viterbi (quant_helpers.beam_encoder; the plain
greedy one leaves a random value per tile: ~6% weight error at 8 bits): this checks structure and
that 8 bits keep the model's function, not the Viterbi's quality (minutes per matrix at 8 bits on
this CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from quant_helpers import beam_encoder, tiny_convert_options

import engine.convert.quantize as quantize_mod
from engine.exl3 import EXL3Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_deepseek import VARIANTS, build_tiny_deepseek, routing_margin  # noqa: E402

IDS = list(range(3, 259, 8))  # 32 tokens
ATTENTION = {
    "DeepseekV3ForCausalLM": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "DeepseekV3ForCausalLM-plain": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _load(directory: Path, exl3_mode: str | None = None):
    from engine.model import load_model

    return load_model(directory, device="cpu", dtype=torch.float32, exl3_mode=exl3_mode)


def _logits(model, ids: list[int], chunk: int = 8) -> torch.Tensor:
    """Logits of ``ids`` prefilled ``chunk`` tokens a step (1: every step a decode step, the
    absorbed form)."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens

    return score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), ids, chunk=chunk)


def _steady_routers(hf, directory: Path) -> None:
    """Selection biases 2.5 times distinct powers of two, so that any two experts, and any two
    groups by the sum of their two best (a sum of sigmoid scores is within 0..2), differ by more
    than scores can make up: every token's groups and experts are the biases' alone. Saved again.
    8 bits move the router's scores by ~0.5%, more than the gap between some tokens' closest
    experts under the parity tests' routers; such a token changes experts and its logits move
    wholesale, which says nothing about the quantization. Here no token can (checked on the
    test's tokens), and the expert weights still vary with each token's scores."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__ == "DeepseekV3TopkRouter":
                order = torch.randperm(module.e_score_correction_bias.numel(), generator=gen)
                module.e_score_correction_bias.copy_(2.5 * 2.0 ** order.float())
    hf.save_pretrained(directory)
    assert routing_margin(hf, IDS)[0] > 0.4


@pytest.mark.slow
@pytest.mark.convert_quality
@pytest.mark.parametrize("variant", VARIANTS)
def test_8_bit_conversion_keeps_the_logits_within_2_percent(variant, tmp_path, monkeypatch):
    from safetensors import safe_open

    from engine.convert.pipeline import convert_model
    from engine.modules.latent_attention import LatentAttention

    monkeypatch.setattr(quantize_mod, "encode_tiles", beam_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    hf = build_tiny_deepseek(variant, src)
    _steady_routers(hf, src)
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    dense = hf.config.first_k_dense_replace
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor(f"model.layers.{dense}.mlp.gate.e_score_correction_bias")
    for name in ATTENTION[variant]:
        assert f"model.layers.0.self_attn.{name}.trellis" in keys, name
    assert f"model.layers.{dense}.mlp.experts.7.gate_proj.trellis" in keys
    assert f"model.layers.{dense}.mlp.shared_experts.down_proj.trellis" in keys
    assert "model.layers.0.self_attn.kv_a_layernorm.weight" in keys
    assert ("model.layers.0.self_attn.q_a_layernorm.weight" in keys) == (variant == "DeepseekV3ForCausalLM")
    assert f"model.layers.{dense}.mlp.gate.weight" in keys  # the router, unquantized
    torch.testing.assert_close(bias.float(), hf.model.layers[dense].mlp.gate.e_score_correction_bias)
    assert not any(k.endswith("_proj.weight") for k in keys)  # no dense projection left

    expected = _logits(_load(src), IDS)
    # EXL3 linears reconstructed once (the CPU's default) or kept packed and decoded on the fly:
    # then kv_b_proj has no weight, and decode steps absorb a decoded copy of it.
    for mode in ("dense", "streaming"):
        quantized = _load(dst, mode)
        mixer = quantized.module.blocks[0].mixer
        assert isinstance(mixer, LatentAttention) and isinstance(mixer.kv_b_proj, EXL3Linear)
        got = _logits(quantized, IDS)
        err = rel_err(got, expected)
        print(f"{variant} ({mode}): 8 bpw logits relative error {err:.4f}")
        assert err < 0.02
        assert rel_err(_logits(quantized, IDS, chunk=1), got) < 1e-4  # every step a decode
