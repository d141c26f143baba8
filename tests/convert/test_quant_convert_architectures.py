"""The converter on every supported text architecture (tiny random checkpoints made by
transformers, tests/engine/tiny_models.py): it converts, the result loads back in our engine with
every projection quantized, and scores close to the source. A fused checkpoint (Phi-3's
``qkv_proj``/``gate_up_proj``) is stored split, as the reference layout stores it.

The trellis encoder is the cheap greedy stand-in (quant_helpers.cheap_encoder), so these check
structure and gross correctness, not the Viterbi's quality."""

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


def _expected_linears(config) -> int:
    """q k v o per layer; gate up down per MLP: the dense one, or each expert's and the shared
    expert's of a mixture-of-experts layer; and the head."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    shared = 1 if getattr(config, "shared_expert_intermediate_size", 0) else 0
    count = 1
    for i in range(config.num_hidden_layers):
        sparse = experts and i not in dense and (i + 1) % step == 0
        count += 4 + 3 * ((experts + shared) if sparse else 1)
    return count


def _convert_and_check(src: Path, dst: Path, layers: int, linears_expected: int | None = None) -> set[str]:
    """Convert ``src`` at 6 bits (greedy encoder), check the result loads with every projection
    and the head quantized and scores close to the source; return the output's tensor keys."""
    from engine.convert.pipeline import convert_model

    options = tiny_convert_options()
    convert_model(src, dst, options, log=lambda m: None)
    source, _ = _logprobs(src)
    quantized, linears = _logprobs(dst)
    # q k v o gate up down per layer, and the head (a tied head is a quantized copy of the embedding)
    assert len(linears) == (linears_expected or 7 * layers + 1)
    kl = float((source.exp() * (source - quantized)).sum(-1).mean())
    assert 0 < kl < 0.02, kl  # 6 bits with the greedy encoder: ~0.0002-0.005 on these models
    return _keys(dst)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in VARIANTS if "-" not in v])  # one per architecture
def test_every_supported_architecture_converts(variant: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    hf = build_tiny_model(variant, src)
    keys = _convert_and_check(src, dst, hf.config.num_hidden_layers, _expected_linears(hf.config))
    assert not any(k.endswith(".weight") and ("_proj" in k) for k in keys)  # no dense projection left
    assert not any(k.endswith(".weight") and ".experts." in k for k in keys)  # Mixtral's w1/w2/w3
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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "expert", "router"),
    [
        ("Qwen3MoeForCausalLM", "mlp.experts.7.gate_proj", "mlp.gate"),
        ("MixtralForCausalLM", "block_sparse_moe.experts.3.w1", "block_sparse_moe.gate"),
    ],
)
def test_mixture_of_experts_keeps_expert_names_and_a_16_bit_router(
    variant: str, expert: str, router: str, tmp_path: Path, monkeypatch
) -> None:
    """Every expert is quantized under its checkpoint name, each with the Hessian of the tokens
    routed to it; the router is copied in fp16, unquantized (as ExLlamaV3 keeps it)."""
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = tmp_path / "src", tmp_path / "exl3"
    hf = build_tiny_model(variant, src)
    keys = _convert_and_check(src, dst, hf.config.num_hidden_layers, _expected_linears(hf.config))
    assert f"model.layers.0.{expert}.trellis" in keys
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        gate = f.get_tensor(f"model.layers.0.{router}.weight")
    assert gate.dtype == torch.float16 and gate.shape == (hf.config.num_local_experts, hf.config.hidden_size)
    storage = json.loads((dst / "quantization_config.json").read_text())["tensor_storage"]
    assert "quant_format" not in storage[f"model.layers.0.{router}"]
    assert storage[f"model.layers.0.{expert}"]["quant_format"] == "exl3"


def test_an_expert_without_calibration_tokens_gets_a_usable_hessian(monkeypatch) -> None:
    """An expert's Hessian with fewer rows than its width is shrunk towards the identity at the
    rows' scale; with none at all it is the identity, which the quantizer takes like any other."""
    from engine.convert.hessians import HessianHook
    from engine.convert.quantize import quantize_weight

    n = 128
    unused = HessianHook(n, torch.device("cpu"), min_rows=n)
    torch.testing.assert_close(unused.hessian(), torch.eye(n))

    x = torch.randn(32, n, generator=torch.Generator().manual_seed(0)) * 3.0
    few = HessianHook(n, torch.device("cpu"), min_rows=n)
    few(None, (x,))
    empirical = x.T @ x / 32
    scale = float(empirical.diagonal().mean())
    torch.testing.assert_close(few.hessian(), 0.25 * empirical + 0.75 * scale * torch.eye(n))
    assert torch.linalg.matrix_rank(empirical) == 32 and torch.linalg.matrix_rank(few.hessian()) == n

    enough = HessianHook(n, torch.device("cpu"), min_rows=16)  # more rows than needed: as measured
    enough(None, (x,))
    torch.testing.assert_close(enough.hessian(), empirical)

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    w = torch.randn(64, n, generator=torch.Generator().manual_seed(1))
    warnings: list[str] = []
    qt = quantize_weight(w, unused.hessian(), 4, device="cpu", warn=warnings.append)
    assert warnings == [] and 0 < qt.proxy_error < 0.15  # 4 bits, greedy encoder: ~0.055
