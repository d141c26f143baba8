"""Tiny random checkpoints of MiMo, IQuest-Coder, HyperCLOVA X, nanochat, Solar Open and DeciLM
(Nemotron-NAS), saved in their Hub layouts, each with a reference that gives its logits.

- HyperCLOVA X, nanochat and Solar Open: transformers' own modeling code (``hyperclovax``,
  ``nanochat``, ``solar_open``).
- IQuest-Coder: transformers maps its ``iquestcoder`` config onto LlamaForCausalLM, which is the
  reference; config.json names the Hub's ``IQuestCoderForCausalLM``.
- MiMo: transformers has no ``mimo``. The Hub's modeling_mimo.py (XiaomiMiMo/MiMo-7B-RL) defines
  ``MiMoModel(Qwen2Model)`` plus ``mtp_layers`` and ``MiMoForCausalLM(Qwen2ForCausalLM)``, so the
  main model's reference is transformers' Qwen2, saved with the MiMo config fields and one
  multi-token-prediction layer's tensors (``model.mtp_layers.0.*``, as the MTP layer names them:
  token/hidden/final layernorms, ``input_proj`` from both halves, attention and MLP).
- DeciLM: transformers has none either; the checkpoint is written by hand (the Hub's
  modeling_decilm.py layout: Llama's tensor names, per-layer ``block_configs``) and its reference
  is written in tests/engine/test_more_families.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import COMMON  # beside this file

VOCAB = COMMON["vocab_size"]
# tiny_models' sizes, less the MLP width: each family below sets its own (or keeps its default).
SMALL = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
# DeciLM's layers, cut to measure: query heads per KV head (None: no attention) and ffn_mult
# (None: no MLP). Widths: 2 * mult * 64 / 3 rounded up to a multiple of 256 (mult 1: 256, 7: 512).
DECI_BLOCKS = [(2, 1.0), (4, 7.0), (None, 7.0), (1, None), (2, 1.0)]

Reference = Callable[[torch.Tensor], torch.Tensor]  # ids [n] -> logits [n, vocab], float32


def _perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """Random init leaves norms at 1 and biases at 0: perturb them so their handling is tested."""
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def _rename(directory: Path, **fields) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config, indent=1))


def _transformers_reference(model) -> Reference:
    def logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids[None]).logits[0].float()

    return logits


def _save(model, directory: Path, seed: int) -> Reference:
    _perturb_norms_and_biases(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return _transformers_reference(model)


def build_hyperclovax(directory: Path, seed: int = 0, post_norms: bool = True) -> Reference:
    """HyperCLOVA X with every μP multiplier away from 1 and biased attention."""
    import transformers as tf

    config = tf.HyperCLOVAXConfig(
        **SMALL,
        intermediate_size=128,
        head_dim=16,
        embedding_multiplier=2.5,
        logits_scaling=0.35,
        residual_multiplier=0.6,
        attention_multiplier=0.09,
        attention_bias=True,
        use_post_norm=post_norms,
    )
    torch.manual_seed(seed)
    return _save(tf.HyperCLOVAXForCausalLM(config).eval(), directory, seed)


def build_nanochat(directory: Path, seed: int = 0) -> Reference:
    import transformers as tf

    config = tf.NanoChatConfig(**SMALL, intermediate_size=256, final_logit_softcapping=15.0)
    torch.manual_seed(seed)
    return _save(tf.NanoChatForCausalLM(config).eval(), directory, seed)


def build_iquest_coder(directory: Path, seed: int = 0) -> Reference:
    import transformers as tf

    if not hasattr(tf, "IQuestCoderConfig"):  # added in a later transformers than some machines have
        pytest.skip("this transformers has no IQuestCoderConfig")
    config = tf.IQuestCoderConfig(**SMALL, intermediate_size=128, head_dim=16)
    torch.manual_seed(seed)
    reference = _save(tf.AutoModelForCausalLM.from_config(config).eval(), directory, seed)
    _rename(directory, architectures=["IQuestCoderForCausalLM"])
    return reference


def build_solar_open(directory: Path, seed: int = 0) -> Reference:
    """Every layer a mixture of 8 experts in 2 groups (1 kept, 2 experts per token, scaled by 2),
    with a shared expert. Routers are made decisive (tests/engine/decisive_routers.py says why):
    random weights spreading the logits, random selection biases."""
    import transformers as tf

    config = tf.SolarOpenConfig(
        **{**SMALL, "num_hidden_layers": 3},
        head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
        attention_bias=True,
    )
    torch.manual_seed(seed)
    model = tf.SolarOpenForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    return _save(model, directory, seed)


def build_mimo(directory: Path, seed: int = 0) -> Reference:
    import transformers as tf

    config = tf.Qwen2Config(**SMALL, intermediate_size=128)
    torch.manual_seed(seed)
    reference = _save(tf.Qwen2ForCausalLM(config).eval(), directory, seed)
    _rename(directory, architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(mtp_tensors(seed))
    save_file(tensors, str(path), metadata={"format": "pt"})
    return reference


def mtp_tensors(seed: int, h: int = 64, f: int = 128, kv: int = 32) -> dict[str, torch.Tensor]:
    """One MiMo multi-token-prediction layer's tensors, random."""
    gen = torch.Generator().manual_seed(seed + 7)
    shapes = {
        "token_layernorm.weight": [h],
        "hidden_layernorm.weight": [h],
        "input_proj.weight": [h, 2 * h],
        "input_layernorm.weight": [h],
        "self_attn.q_proj.weight": [h, h],
        "self_attn.q_proj.bias": [h],
        "self_attn.k_proj.weight": [kv, h],
        "self_attn.k_proj.bias": [kv],
        "self_attn.v_proj.weight": [kv, h],
        "self_attn.v_proj.bias": [kv],
        "self_attn.o_proj.weight": [h, h],
        "post_attention_layernorm.weight": [h],
        "mlp.gate_proj.weight": [f, h],
        "mlp.up_proj.weight": [f, h],
        "mlp.down_proj.weight": [h, f],
        "final_layernorm.weight": [h],
    }
    return {f"model.mtp_layers.0.{k}": 0.05 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def deci_config() -> dict:
    blocks = []
    for group, mult in DECI_BLOCKS:
        attention = {"no_op": True} if group is None else {"n_heads_in_group": group, "no_op": False}
        ffn = {"no_op": True} if mult is None else {"ffn_mult": mult, "no_op": False}
        blocks.append({"attention": {"replace_with_linear": False, **attention}, "ffn": ffn})
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": len(blocks),
        "num_key_value_heads": None,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "block_configs": blocks,
        "torch_dtype": "float32",
    }


def deci_mlp_width(ffn_mult: float, hidden_size: int) -> int:
    """modeling_decilm.py's ``_ffn_mult_to_intermediate_size``: ``int(2 * ffn_mult * hidden / 3)``
    rounded up to a multiple of 256."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


def deci_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in the Hub's DeciLM layout for ``config``."""
    gen = torch.Generator().manual_seed(seed)
    h, heads, vocab = config["hidden_size"], config["num_attention_heads"], config["vocab_size"]
    d = h // heads

    def rand(*shape: int) -> torch.Tensor:  # transformers' initializer_range
        return torch.randn(shape, generator=gen) * 0.02

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(h, generator=gen)

    out = {"model.embed_tokens.weight": rand(vocab, h)}
    for i, block in enumerate(config["block_configs"]):
        p = f"model.layers.{i}."
        attention, ffn = block["attention"], block["ffn"]
        if not attention.get("no_op"):
            kv = heads // attention["n_heads_in_group"]
            out[p + "input_layernorm.weight"] = norm()
            out[p + "self_attn.q_proj.weight"] = rand(heads * d, h)
            out[p + "self_attn.k_proj.weight"] = rand(kv * d, h)
            out[p + "self_attn.v_proj.weight"] = rand(kv * d, h)
            out[p + "self_attn.o_proj.weight"] = rand(h, heads * d)
        if not ffn.get("no_op"):
            f = deci_mlp_width(ffn["ffn_mult"], h)
            out[p + "post_attention_layernorm.weight"] = norm()
            out[p + "mlp.gate_proj.weight"] = rand(f, h)
            out[p + "mlp.up_proj.weight"] = rand(f, h)
            out[p + "mlp.down_proj.weight"] = rand(h, f)
    out["model.norm.weight"] = norm()
    out["lm_head.weight"] = rand(vocab, h)
    return out


def build_deci(directory: Path, seed: int = 0, config: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a tiny DeciLM checkpoint; returns its tensors (the reference's weights)."""
    config = config or deci_config()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tensors = deci_tensors(config, seed)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


# The families whose references come from transformers (DeciLM's is the test's own).
BUILDERS: dict[str, Callable[[Path], Reference]] = {
    "MiMoForCausalLM": build_mimo,
    "IQuestCoderForCausalLM": build_iquest_coder,
    "HyperCLOVAXForCausalLM": build_hyperclovax,
    "NanoChatForCausalLM": build_nanochat,
    "SolarOpenForCausalLM": build_solar_open,
}
