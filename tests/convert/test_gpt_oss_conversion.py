"""gpt-oss from its Hub layout to EXL3: a tiny model whose experts are stored in MXFP4 (blocks and
scales, tests/engine/tiny_gpt_oss.py) converts at 8 bits per weight. Each expert is quantized
under its own name with its biases (as ExLlamaV3 stores gpt-oss), the router and the attention
sinks are copied in 16 bits, nothing of the MXFP4 pairs or the fused tensors is left, and the
result loads back with every projection EXL3 and scores close to the source.

The trellis encoder is the cheap greedy stand-in (quant_helpers.cheap_encoder), as in the other
conversion tests: the real Viterbi takes minutes per block on this CPU. Its tile-start errors
(~8% relative RMS per weight at any bit width) bound the closeness that can be asserted here: the
distributions (KL), not the raw logits of this deliberately sensitive model (logits of std ~0.16,
where the beam stand-in still leaves more than 2% relative error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder, tiny_convert_options
from safetensors import safe_open

import engine.convert.quantize as quantize_mod
from engine.exl3 import EXL3Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_gpt_oss import build_tiny_gpt_oss  # noqa: E402

IDS = list(range(3, 67))


def _logits(directory: Path):
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(directory, device="cpu", dtype=torch.float32)
    cache = PagedKVCache.for_model(model.spec, 128, page_size=16)
    return score_tokens(model.module, cache, IDS), model


@pytest.mark.slow
def test_an_mxfp4_gpt_oss_converts_to_exl3(tmp_path: Path, monkeypatch) -> None:
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    src.mkdir()
    hf = build_tiny_gpt_oss(src, mxfp4=True)
    report = convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)
    assert report.bits == 8.0

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        router = f.get_tensor("model.layers.0.mlp.router.weight")
        sinks = f.get_tensor("model.layers.1.self_attn.sinks")
    p = "model.layers.0.mlp.experts."
    for e in range(hf.config.num_local_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert {f"{p}{e}.{proj}.trellis", f"{p}{e}.{proj}.bias"} <= keys
    assert not any(k.endswith(("_blocks", "_scales")) or "gate_up_proj" in k for k in keys)
    assert not any(k.endswith(".weight") and "_proj" in k for k in keys)  # every projection quantized
    assert router.dtype == torch.float16 and "model.layers.0.mlp.router.bias" in keys
    assert torch.equal(sinks, hf.model.layers[1].self_attn.sinks.detach().half())
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3"
    assert config["quantization_config"]["original_quantization_config"]["quant_method"] == "mxfp4"

    source, _ = _logits(src)
    quantized, model = _logits(dst)
    linears = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    layers, experts = hf.config.num_hidden_layers, hf.config.num_local_experts
    assert len(linears) == layers * (4 + 3 * experts) + 1  # q k v o, each expert's three, the head
    a, b = source.log_softmax(-1), quantized.log_softmax(-1)
    kl = float((a.exp() * (a - b)).sum(-1).mean())
    assert 0 < kl < 0.005, kl  # ~0.0005 with the stand-in encoder
