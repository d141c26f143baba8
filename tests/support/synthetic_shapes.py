"""Configs of tiny models, as dicts: what ``bench --synthetic`` reads from a JSON file and
``engine.loading.synthetic_store.synthetic_model`` builds with random weights."""

from __future__ import annotations

from typing import Any


def tiny_llama_shape(**fields: Any) -> dict[str, Any]:
    """A Llama of 2 layers, hidden size 128, MLP width 256, 4 query and 2 KV heads of 32, a
    vocabulary of 320; ``fields`` replace or add config keys."""
    shape = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 320,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return {**shape, **fields}


def tiny_moe_shape(**fields: Any) -> dict[str, Any]:
    """:func:`tiny_llama_shape` as a Qwen3-MoE: every layer's MLP 8 routed experts of width 128,
    2 per token; ``fields`` replace or add config keys (another family's ``architectures`` and
    ``model_type`` among them)."""
    moe = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    }
    return tiny_llama_shape(**{**moe, **fields})
