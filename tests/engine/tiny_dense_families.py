"""Tiny random models of the dense families that differ from Llama in their norms, MLPs, RoPE or
layer patterns (GLM-4, Ernie 4.5, EXAONE 4, OLMo 3, Command R and R7B, Arcee, Apertus, Seed-OSS),
built with transformers' own config classes (tiny_models.build_tiny_model saves them); and where
ExLlamaV3 keeps each one's tensors in an EXL3 conversion, as its architecture files name them."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import COMMON, build_tiny_model

# Heads of 16 unless a config says otherwise; pad id 0 (the families' own defaults lie outside
# a vocabulary of 320).
_BASE = dict(COMMON, pad_token_id=0)


def configs() -> dict:
    import transformers as tf

    return {
        # Sandwich norms, q/k/v biases (none on o_proj), fused gate_up_proj, half of each head
        # rotated by adjacent pairs, heads wider than hidden / heads.
        "Glm4ForCausalLM": tf.Glm4Config(**_BASE, head_dim=32, attention_bias=True),
        # Adjacent-pair RoPE, biases on every projection, a tied head.
        "Ernie4_5ForCausalLM": tf.Ernie4_5Config(**_BASE, head_dim=16, use_bias=True),
        # Post-norms, per-head q/k norms; sliding layers 0 and 2 rotate, global layers 1 and 3 are NoPE.
        "Exaone4ForCausalLM": tf.Exaone4Config(
            **_BASE, head_dim=16, sliding_window=16, sliding_window_pattern=2
        ),
        # ... and without a sliding window (EXAONE 4.0 1.2B): every layer global and rotated.
        "Exaone4ForCausalLM-global": tf.Exaone4Config(
            **_BASE, head_dim=16, sliding_window=None, layer_types=["full_attention"] * 4
        ),
        # Post-norms, q/k norms across all heads, layers 0-2 sliding, 3 global.
        "Olmo3ForCausalLM": tf.Olmo3Config(**_BASE, sliding_window=16),
        # Parallel attention and MLP after one LayerNorm; per-head q/k LayerNorms with a scale per
        # head (Command R+), biases, adjacent-pair RoPE, scaled logits, a tied head.
        "CohereForCausalLM": tf.CohereConfig(
            **_BASE, use_qk_norm=True, attention_bias=True, logit_scale=0.25
        ),
        # ... with layers 0-2 sliding and rotated, layer 3 global and NoPE.
        "Cohere2ForCausalLM": tf.Cohere2Config(**_BASE, sliding_window=16, logit_scale=0.5),
        # An MLP without a gate: down(relu(up(x))^2).
        "ArceeForCausalLM": tf.ArceeConfig(**_BASE),
        # xIELU MLPs (learned curvatures per layer), per-head q/k norms, Llama 3 RoPE scaling.
        "ApertusForCausalLM": tf.ApertusConfig(
            **_BASE,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 12000000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # q/k/v biases but none on o_proj (attention_out_bias).
        "SeedOssForCausalLM": tf.SeedOssConfig(
            **_BASE, head_dim=16, attention_bias=True, attention_out_bias=False
        ),
    }


DENSE_FAMILIES = [
    "Glm4ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Exaone4ForCausalLM",
    "Exaone4ForCausalLM-global",
    "Olmo3ForCausalLM",
    "CohereForCausalLM",
    "Cohere2ForCausalLM",
    "ArceeForCausalLM",
    "ApertusForCausalLM",
    "SeedOssForCausalLM",
]


def build_tiny_dense_model(variant: str, directory: Path, seed: int = 0, dtype=torch.float32):
    """Save a random model of ``variant`` (a key of :func:`configs`) to ``directory``; returns
    the transformers model."""
    return build_tiny_model(variant, directory, seed, dtype, config=configs()[variant])


# Per family, the modules of one decoder layer in an EXL3 conversion as ExLlamaV3 reads them
# (exllamav3/architecture/<family>.py): quantized linears, and tensors kept unquantized (norms,
# xIELU's curvatures). A fused source projection (GLM-4's gate_up_proj) is stored split.
_ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
_GATED = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
_PLAIN = ["mlp.up_proj", "mlp.down_proj"]
_QK_NORMS = ["self_attn.q_norm", "self_attn.k_norm"]
_LLAMA_NORMS = ["input_layernorm", "post_attention_layernorm"]
_POST_NORMS = ["post_attention_layernorm", "post_feedforward_layernorm"]

EXLLAMAV3_LAYER: dict[str, tuple[list[str], list[str]]] = {
    "Glm4ForCausalLM": (
        _ATTENTION + _GATED,
        ["input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"],
    ),
    "Ernie4_5ForCausalLM": (_ATTENTION + _GATED, _LLAMA_NORMS),
    "Exaone4ForCausalLM": (_ATTENTION + _GATED, _POST_NORMS + _QK_NORMS),
    "Olmo3ForCausalLM": (_ATTENTION + _GATED, _POST_NORMS + _QK_NORMS),
    "CohereForCausalLM": (_ATTENTION + _GATED, ["input_layernorm", *_QK_NORMS]),
    "Cohere2ForCausalLM": (_ATTENTION + _GATED, ["input_layernorm"]),
    "ArceeForCausalLM": (_ATTENTION + _PLAIN, _LLAMA_NORMS),
    "ApertusForCausalLM": (
        _ATTENTION + _PLAIN,
        [
            "attention_layernorm",
            "feedforward_layernorm",
            *_QK_NORMS,
            "mlp.act_fn.alpha_p",
            "mlp.act_fn.alpha_n",
        ],
    ),
    "SeedOssForCausalLM": (_ATTENTION + _GATED, _LLAMA_NORMS),
}
