"""The converter on the dense families of tests/engine/tiny_dense_families.py (GLM-4, Ernie 4.5,
EXAONE 4, OLMo 3, Command R and R7B, Arcee, Apertus, Seed-OSS): at 8 bits per weight the result
loads back with every projection quantized, under the names ExLlamaV3 stores the family's
tensors by (GLM-4's fused gate_up_proj split, Apertus' xIELU curvatures copied), and its logits
are within 2% of the source's.

The trellis encoder is a stand-in for the Viterbi (quant_helpers.beam_encoder) and the scale
search tries 5 scales on one tile column, as in test_routed_moe_conversion.py. The search keeps 8
beams, not 4: the post-norm families (EXAONE 4, OLMo 3) rescale each sub-layer's output before it
joins the stream, so a weight's relative error reaches the logits undamped, and with 4 beams the
stand-in's own error (2.4% on EXAONE 4, 1.5% with 8) would decide the test."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from parity import random_ids, rel_err
from quant_helpers import beam_encoder, tiny_convert_options
from safetensors import safe_open

import engine.convert.quantize as quantize_mod
from engine.exl3 import EXL3Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_dense_families import DENSE_FAMILIES, EXLLAMAV3_LAYER, build_tiny_dense_model  # noqa: E402

IDS = random_ids(32, seed=7)


def _logits(directory: Path) -> tuple[torch.Tensor, list[EXL3Linear]]:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(directory, device="cpu", dtype=torch.float32)
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), IDS)
    return logits, [m for m in model.module.modules() if isinstance(m, EXL3Linear)]


@pytest.mark.slow  # ~10 s each on two cores
@pytest.mark.parametrize("variant", [v for v in DENSE_FAMILIES if "-" not in v])
def test_8_bit_conversion_keeps_the_logits_within_2_percent(variant, tmp_path, monkeypatch):
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", functools.partial(beam_encoder, beams=8))
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    monkeypatch.setattr(quantize_mod, "SCALE_GRID", (0.4, 0.55, 0.7, 0.85, 1.0))
    src, dst = tmp_path / "src", tmp_path / "exl3"
    layers = build_tiny_dense_model(variant, src).config.num_hidden_layers
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    source, _ = _logits(src)
    quantized, linears = _logits(dst)
    layer_linears, layer_others = EXLLAMAV3_LAYER[variant]
    assert len(linears) == layers * len(layer_linears) + 1  # and the head
    err = rel_err(quantized, source)
    print(f"{variant}: 8 bpw logits relative error {err:.4f}")
    assert err < 0.02

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for i in range(layers):
        for name in layer_linears:
            assert f"model.layers.{i}.{name}.trellis" in keys
        for name in layer_others:
            assert f"model.layers.{i}.{name}" in keys or f"model.layers.{i}.{name}.weight" in keys
    assert not [k for k in keys if k.endswith("_proj.weight")]  # no projection left dense
