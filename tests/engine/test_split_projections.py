"""A fused checkpoint (Phi-3: ``qkv_proj``, ``gate_up_proj``) also loads with its projections
stored split under the separate names, as EXL3 conversions store them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model


def test_phi3_with_split_projections_gives_the_same_logits(tmp_path: Path) -> None:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    fused_dir, split_dir = tmp_path / "fused", tmp_path / "split"
    hf = build_tiny_model("Phi3ForCausalLM", fused_dir)
    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q, kv, f = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim, cfg.intermediate_size
    tensors = load_file(str(fused_dir / "model.safetensors"))
    split = {}
    for key, t in tensors.items():
        if key.endswith("self_attn.qkv_proj.weight"):
            base = key[: -len("qkv_proj.weight")]
            for name, part in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                split[f"{base}{name}.weight"] = part.clone()
        elif key.endswith("mlp.gate_up_proj.weight"):
            base = key[: -len("gate_up_proj.weight")]
            for name, part in zip(("gate_proj", "up_proj"), t.split([f, f])):
                split[f"{base}{name}.weight"] = part.clone()
        else:
            split[key] = t
    split_dir.mkdir()
    save_file(split, str(split_dir / "model.safetensors"), metadata={"format": "pt"})
    (split_dir / "config.json").write_text((fused_dir / "config.json").read_text())
    logits = []
    for directory in (fused_dir, split_dir):
        model = load_model(directory, device="cpu", dtype=torch.float32)
        cache = PagedKVCache.for_model(model.spec, 16, page_size=16)
        logits.append(score_tokens(model.module, cache, [1, 7, 3, 11, 5]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_a_damaged_fused_checkpoint_names_its_fused_tensor(tmp_path: Path) -> None:
    import pytest

    from engine.errors import ModelLoadError
    from engine.model import load_model

    build_tiny_model("Phi3ForCausalLM", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(tmp_path, device="cpu", dtype=torch.float32)
