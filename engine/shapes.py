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


def _qwen35_layers(n: int) -> list[str]:
    """Qwen3.5's hybrid schedule: three gated-delta-net layers, then one of full attention."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


# Qwen3.5 (text): the fields its dense and MoE configs share.
_QWEN35_TEXT = {
    "num_attention_heads": 16,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}


def _gemma4_layers(n: int) -> list[str]:
    """Gemma 4's schedule: five sliding-window layers, then one of full attention."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


# Gemma 4 31B (google/gemma-4-31B's text decoder): sliding layers with 16 KV heads of 256, full
# layers with 4 KV heads of 512 whose keys double as values, proportional RoPE on a quarter of
# the full layers' pairs; tied head, final logits soft-capped at 30.
_GEMMA4_31B = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 4,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "layer_types": _gemma4_layers(60),
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
    "hidden_size_per_layer_input": 0,
    "vocab_size": 262144,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
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
    "qwen3.5-9b": {
        **_QWEN35_TEXT,
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
        "layer_types": _qwen35_layers(32),
    },
    "qwen3.5-35b-a3b": {
        **_QWEN35_TEXT,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "layer_types": _qwen35_layers(40),
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    "gemma4-31b": _GEMMA4_31B,
    # Mixtures of experts (bench --synthetic: random EXL3 experts, dense routers). gpt-oss-20b:
    # 32 experts of 2880 (padded to 2944 in EXL3), 4 per token, alternating 128-token sliding and
    # full attention with sinks.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        "attention_bias": True,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": 200002,
        "pad_token_id": 199999,
    },
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token, every layer sparse.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # GLM-4.5-Air: a dense first layer, then 128 experts of 1408 (8 per token, sigmoid router with
    # a selection bias) and one shared expert; RoPE on half of each head.
    "glm4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "vocab_size": 151552,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": [151329, 151336, 151338],
        "pad_token_id": 151329,
    },
    # Nemotron-H 8B: 24 Mamba-2, 4 attention and 24 MLP layers, one block each.
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 4096,
        "intermediate_size": 21504,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "expand": 2,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "mlp_hidden_act": "relu2",
        "time_step_limit": [0.0, float("inf")],
        "vocab_size": 131072,
        "max_position_embeddings": 8192,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "residual_in_fp32": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
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
