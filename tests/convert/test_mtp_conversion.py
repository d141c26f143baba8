"""A conversion keeps a checkpoint's multi-token-prediction layer, unquantized: the converter
quantizes the blocks it runs its calibration rows through, and the MTP layer is not one of them
(it reads the final hidden states, not the residual stream of the block before). Its tensors are
copied as 16-bit floats, so ``--draft mtp`` works on the converted model as on the source."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from quant_helpers import cheap_encoder, tiny_convert_options
from safetensors.torch import load_file

import engine.convert.quantize as quantize_mod
from engine.convert.pipeline import convert_model
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_mtp import build_with_mtp  # noqa: E402


def test_the_mtp_layer_is_copied_unquantized_and_drafts_on_the_converted_model(tmp_path, monkeypatch):
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    build_with_mtp("DeepseekV3ForCausalLM", src)
    convert_model(src, dst, tiny_convert_options(bits=4.0, cal_rows=2), log=lambda m: None)
    source, out = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    mtp = sorted(k for k in source if k.startswith("model.layers.4."))
    assert mtp and all(k in out for k in mtp)
    for key in mtp:
        assert out[key].dtype == torch.float16
        torch.testing.assert_close(out[key].float(), source[key].half().float())
    assert any(k.endswith(".trellis") for k in out)  # the main layers are quantized

    model = load_model(dst, device="cpu")
    prompts = [list(range(5, 40)), list(range(100, 112))]
    kw = dict(cache_tokens=512, page_size=16)
    plain = Generator(model, **kw).generate([Job(p, 16, stop_token_ids=()) for p in prompts])
    gen = Generator(model, options=EngineOptions(draft="mtp", draft_tokens=3), **kw)
    got = gen.generate([Job(p, 16, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert gen.speculation.stats.drafted > 0
