"""Model shapes for synthetic (random-weight) benchmarks and timing runs, as HF ``config.json`` dicts.

The numbers are those of the published models' configs; the weights are never needed, only the
shapes, so a benchmark or a conversion timing can run anywhere without a download.
"""

from __future__ import annotations

import copy
from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Llama 3.1: the fields its 8B and 70B configs share.
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama3.1-8b": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama3.1-70b": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def shape_config(name: str) -> dict[str, Any]:
    """A fresh copy of the config of shape ``name``; the error lists the known shapes."""
    try:
        return copy.deepcopy(SHAPES[name])
    except KeyError:
        raise ValueError(f"unknown model shape '{name}' (known: {', '.join(sorted(SHAPES))})") from None


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each linear of one decoder layer of a Llama-like config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
