"""The converter on every supported text architecture (tiny random checkpoints made by
transformers, tests/engine/tiny_models.py): it converts, the result loads back in our engine with
every projection quantized, and scores close to the source. A fused checkpoint (Phi-3's
``qkv_proj``/``gate_up_proj``) is stored split, as the reference layout stores it.

The trellis encoder is the cheap greedy stand-in (quant_helpers.cheap_encoder), so these check
structure and gross correctness, not the Viterbi's quality."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder
from safetensors import safe_open

import engine.quant.quantize as quantize_mod
from engine.quant import EXL3Linear

sys.path[:0] = [str(Path(__file__).parents[1] / d) for d in ("engine", "vision")]
from tiny_models import VARIANTS, build_tiny_model  # noqa: E402
from tiny_processors import write_processor_files  # noqa: E402
from tiny_vlms import VL_ARCHITECTURES, build_tiny_vlm  # noqa: E402

IDS = [1, 5, 9, 13, 17, 21, 25, 29]


def _logprobs(directory: Path) -> tuple[torch.Tensor, list[EXL3Linear]]:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(directory, device="cpu", dtype=torch.float32)
    cache = PagedKVCache.for_model(model.spec, 16, page_size=16)
    logits = score_tokens(model.module, cache, IDS)
    return logits.log_softmax(-1), [m for m in model.module.modules() if isinstance(m, EXL3Linear)]


def _keys(directory: Path) -> set[str]:
    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    return keys


def _convert_and_check(src: Path, dst: Path, layers: int) -> set[str]:
    """Convert ``src`` at 6 bits (greedy encoder), check the result loads with every projection
    and the head quantized and scores close to the source; return the output's tensor keys."""
    from engine.quant.convert import ConvertOptions, convert_model

    options = ConvertOptions(
        bits=6.0,
        head_bits=8,
        cal_rows=4,
        cal_cols=32,
        device="cpu",
        allocation="uniform",
        random_rows_fraction=1.0,  # the tiny checkpoints have no tokenizer
    )
    convert_model(src, dst, options, log=lambda m: None)
    source, _ = _logprobs(src)
    quantized, linears = _logprobs(dst)
    # q k v o gate up down per layer, and the head (a tied head is a quantized copy of the embedding)
    assert len(linears) == 7 * layers + 1
    kl = float((source.exp() * (source - quantized)).sum(-1).mean())
    assert 0 < kl < 0.02, kl  # 6 bits with the greedy encoder: ~0.0002-0.005 on these models
    return _keys(dst)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in VARIANTS if "-" not in v])  # one per architecture
def test_every_supported_architecture_converts(variant: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    hf = build_tiny_model(variant, src)
    keys = _convert_and_check(src, dst, hf.config.num_hidden_layers)
    assert not any(k.endswith(".weight") and ("_proj" in k) for k in keys)  # no dense projection left
    if variant.startswith("Phi3"):
        assert "model.layers.0.self_attn.q_proj.trellis" in keys
        assert "model.layers.0.mlp.up_proj.trellis" in keys
        assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("arch", VL_ARCHITECTURES)
def test_vision_language_models_convert_their_decoder(arch: str, tmp_path: Path, monkeypatch) -> None:
    """The decoder (nested under the family's prefix) is quantized; the vision tower and the
    projector are copied unquantized; the result loads with its vision model and scores text
    close to the source."""
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    hf = build_tiny_vlm(arch, src)
    write_processor_files(arch, hf.config, src)
    keys = _convert_and_check(src, dst, hf.config.get_text_config().num_hidden_layers)
    src_keys = _keys(src)
    tower = ("vision", "visual")
    decoder = {
        k
        for k in src_keys
        if ".layers." in k and k.endswith("_proj.weight") and not any(t in k for t in tower)
    }
    assert decoder and not (decoder & keys)  # every decoder projection became EXL3 tensors
    others = src_keys - decoder - {k for k in src_keys if k.endswith("lm_head.weight")}
    assert others <= keys  # vision tower, projector, norms, embedding: all copied
    from engine.model import load_model

    assert load_model(dst, device="cpu", dtype=torch.float32).vision is not None
