"""GLM-4.1V and GLM-4.5V in EXL3 (the tiny models of tests/engine/tiny_glm4v.py).

- ``engine convert`` at 8 bits per weight: every linear of the decoder is quantized under the name
  ExLlamaV3 stores it by (GLM-4's fused gate_up_proj split, experts one by one), the vision tower
  is copied unquantized, the routers stay 16-bit, and the result loads back with its vision model;
  its logits over a text prompt and over a prompt with an image are within 2% of the source's.
  The trellis encoder is the beam stand-in for the Viterbi (quant_helpers.beam_encoder) with a
  short scale search, as in test_more_families_conversion.py.
- A checkpoint in ExLlamaV3's layout loads: the linears ExLlamaV3's architecture files for the
  families quantize, under its key names, are EXL3 and every one of them is read as such
  (tests/support/exl3_layout.py).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from exl3_layout import write_exl3_model
from parity import random_ids, rel_err
from PIL import Image
from quant_helpers import beam_encoder, tiny_convert_options
from safetensors import safe_open

import engine.convert.quantize as quantize_mod
from engine.exl3 import EXL3Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_glm4v import VARIANTS, build_tiny_glm4v, exllamav3_linears  # noqa: E402

IDS = random_ids(32, seed=7)
PICTURE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 45, 3), dtype=np.uint8))


def _logits(directory: Path) -> tuple[torch.Tensor, torch.Tensor, list[EXL3Linear]]:
    """Logits over IDS, over a prompt with PICTURE, and the model's EXL3 linears."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model
    from engine.tokenizer import Tokenizer
    from engine.vision.prompt import encode_chat_with_images, user_message

    model = load_model(directory, device="cpu", dtype=torch.float32)
    text = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), IDS)
    messages = [user_message("What is in this picture?", 1)]
    ids, media = encode_chat_with_images(Tokenizer.from_dir(directory), model.vision, messages, [PICTURE])
    cache = PagedKVCache.for_model(model.spec, 128, page_size=16)
    image = score_tokens(model.module, cache, ids, media=media)
    return text, image, [m for m in model.module.modules() if isinstance(m, EXL3Linear)]


# GLM-4.5V's 16 experts take ~20 s on a CPU core: with the quality runs.
SLOW = ("Glm4vMoeForConditionalGeneration",)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=pytest.mark.convert_quality) if v in SLOW else v for v in VARIANTS]
)
def test_8_bit_conversion_keeps_the_logits_within_2_percent(variant, tmp_path, monkeypatch):
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", beam_encoder)
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    monkeypatch.setattr(quantize_mod, "SCALE_GRID", (0.4, 0.55, 0.7, 0.85, 1.0))
    src, dst = tmp_path / "src", tmp_path / "exl3"
    build_tiny_glm4v(variant, src)
    convert_model(src, dst, tiny_convert_options(bits=8.0, head_bits=8), log=lambda m: None)

    source_text, source_image, _ = _logits(src)
    text, image, linears = _logits(dst)
    expected = exllamav3_linears(json.loads((src / "config.json").read_text()))
    assert {m.key for m in linears} == set(expected)  # every linear, under ExLlamaV3's names
    errors = rel_err(text, source_text), rel_err(image, source_image)
    print(f"{variant}: 8 bpw logits relative error {errors[0]:.4f} (text), {errors[1]:.4f} (image)")
    assert max(errors) < 0.02

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tower = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.visual.")}
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert tower.keys() <= keys  # the tower is copied, not quantized
        for key, tensor in tower.items():
            torch.testing.assert_close(f.get_tensor(key).float(), tensor, atol=2e-3, rtol=2e-3)
    routers = {k.removesuffix(".weight") for k in keys if k.endswith("mlp.gate.weight")}
    assert len(routers) == (2 if variant == "Glm4vMoeForConditionalGeneration" else 0)
    assert not {k.removesuffix(".trellis") for k in keys if k.endswith(".trellis")} & routers


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_in_exllamav3_layout_loads(variant, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "exl3"
    build_tiny_glm4v(variant, src)
    config = json.loads((src / "config.json").read_text())
    linears = exllamav3_linears(config)
    # transformers saves GLM-4V's gate and up projections fused; ExLlamaV3 stores them apart
    layers = range(config["text_config"]["num_hidden_layers"])
    fused = tuple(f"model.language_model.layers.{i}.mlp.gate_up_proj" for i in layers)
    write_exl3_model(src, dst, linears, bits=4, drop=fused)
    for path in src.iterdir():  # tokenizer, chat template, image processor settings
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    text, image, loaded = _logits(dst)
    assert {m.key for m in loaded} == set(linears) and {m.bits for m in loaded} == {4}
    assert text.shape == (len(IDS), 320) and torch.isfinite(text).all() and torch.isfinite(image).all()
