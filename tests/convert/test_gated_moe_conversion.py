"""The converter on AFMoE, Step 3.7 and Qwen3-VL-MoE (the tiny models of tests/engine: spread routers,
tiny_qwen3_vl_moe.py): every projection of attention (the output gates' own projections too), dense
MLPs, routed and shared experts becomes EXL3 under its checkpoint name, Step's stacked experts and
Qwen's fused ones one linear per expert; routers and their selection biases are copied unquantized,
Qwen3-VL-MoE's vision tower too; the result loads back and at 8 bits per weight its logits are
within 2% of the source's.

The trellis encoder is a beam-search stand-in for the Viterbi (quant_helpers.beam_encoder), and the
scale search samples one tile column per candidate (of every tile column, 1/8 of the default): the
greedy quant_helpers.cheap_encoder's error at 8 bits (~10% per matrix, from the first value of each
tile) would swamp a 2% bound. Routing is part of what is compared: the routers here decide clearly
(spread_routers.py), and no token's expert choice flips between the source and its conversion."""

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
from spread_routers import build_spread_model  # noqa: E402
from tiny_qwen3_vl_moe import build_tiny_qwen3_vl_moe  # noqa: E402

IDS = list(range(3, 259, 8))  # 32 tokens

# Per family: (a routed expert's projection, the output gate's projection or None, its router,
# its selection bias or None) in layer 1.
KEYS = {
    "AfmoeForCausalLM": (
        "mlp.experts.7.gate_proj",
        "self_attn.gate_proj",
        "mlp.router.gate",
        "mlp.expert_bias",
    ),
    "Step3p7ForConditionalGeneration": (
        "moe.experts.7.gate_proj",
        "self_attn.g_proj",
        "moe.gate",
        "moe.router_bias",
    ),
    "Qwen3VLMoeForConditionalGeneration": ("mlp.experts.7.gate_proj", None, "mlp.gate", None),
}
PREFIX = {"Qwen3VLMoeForConditionalGeneration": "model.language_model.layers.1."}


def _build(variant: str, directory: Path) -> None:
    if variant == "Qwen3VLMoeForConditionalGeneration":
        build_tiny_qwen3_vl_moe(directory)
    else:
        build_spread_model(variant, directory)


def _logits(directory: Path):
    """The model's logits over IDS, the experts each of its MoE layers chose for each token, its
    EXL3 linears, and the model."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model
    from engine.modules.moe import SparseMoE

    model = load_model(directory, device="cpu", dtype=torch.float32)
    choices: list[torch.Tensor] = []

    def record(moe, args, out) -> None:
        choices.append(moe.route(args[0])[1].sort(dim=-1).values)

    hooks = [m.register_forward_hook(record) for m in model.module.modules() if isinstance(m, SparseMoE)]
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), IDS)
    for hook in hooks:
        hook.remove()
    linears = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    return logits, torch.stack(choices), linears, model


def _expected_linears(directory: Path) -> int:
    """q k v o (and the gate's projection) per layer; gate up down of each dense MLP, or of each
    routed expert and the shared expert; and the head."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(directory)
    count = 1
    for layer in architecture_for(cfg.architecture).spec(cfg).layers:
        ff = layer.feed_forward
        experts = ff.num_experts + bool(ff.shared_expert_size) if ff.kind == "sparse_moe" else 1
        count += 4 + (layer.mixer.gate_proj is not None) + 3 * experts
    return count


@pytest.mark.slow
@pytest.mark.convert_quality
@pytest.mark.parametrize("variant", list(KEYS))
def test_8_bit_conversion_keeps_the_logits_within_2_percent(variant, tmp_path, monkeypatch):
    from safetensors import safe_open

    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", beam_encoder)
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    _build(variant, src)
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    source, source_choices, _, _ = _logits(src)
    quantized, choices, linears, model = _logits(dst)
    assert len(linears) == _expected_linears(src)
    assert torch.equal(choices, source_choices)
    err = float((quantized - source).norm() / source.norm())
    print(f"{variant}: 8 bpw logits relative error {err:.4f}")
    assert err < 0.02

    prefix = PREFIX.get(variant, "model.layers.1.")
    expert, gate, router, bias = (k and prefix + k for k in KEYS[variant])
    storage = json.loads((dst / "quantization_config.json").read_text())["tensor_storage"]
    assert storage[expert]["quant_format"] == "exl3" and storage[expert]["bits_per_weight"] == 8
    assert gate is None or storage[gate]["quant_format"] == "exl3"
    assert "quant_format" not in storage[router]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor(f"{router}.weight").shape == (8, 64)
        assert bias is None or f.get_tensor(bias).shape == (8,)
        # no dense projection left, and no 3-D expert tensor: every expert is stored apart
        assert not any(k.endswith("_proj.weight") and ".layers." in k and "visual" not in k for k in keys)
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    if variant == "Qwen3VLMoeForConditionalGeneration":
        assert model.vision is not None
