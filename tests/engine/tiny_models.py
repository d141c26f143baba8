"""Tiny random Hugging Face models of every supported architecture, built with transformers'
own config classes and saved with ``save_pretrained`` (the reference for parity tests)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


# The gated-delta-net hybrids' layers and their mixtures of experts.
_DELTA_NET = dict(
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)
_EXPERTS = dict(
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2]
)

# DeepSeek-V3's latent attention (every head's key and value from a 32-wide latent, rows of 48
# numbers cached per position) and its mixtures of experts. MLA has no grouped KV heads.
_LATENT = dict(
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.8,
        "mscale_all_dim": 1.0,
    },
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)

# GLM-4.5's mixtures of experts (and GLM-4.5V's decoder's): layer 0 dense, then sigmoid routers
# over 4 groups of 2 experts (2 groups kept, 3 experts chosen), scaled by 2.5, and a shared expert.
GLM4_MOE_EXPERTS = dict(
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)


def _configs():
    import transformers as tf

    return {
        "LlamaForCausalLM": tf.LlamaConfig(**COMMON),
        "LlamaForCausalLM-llama3": tf.LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "LlamaForCausalLM-yarn": tf.LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        "MistralForCausalLM": tf.MistralConfig(**COMMON, sliding_window=16, head_dim=16),
        "Qwen2ForCausalLM": tf.Qwen2Config(**COMMON),
        "Qwen3ForCausalLM": tf.Qwen3Config(**COMMON, head_dim=32),
        "Gemma2ForCausalLM": tf.Gemma2Config(
            **COMMON,
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        "Gemma3ForCausalLM": tf.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 6}, head_dim=16, sliding_window=16, query_pre_attn_scalar=16
        ),
        "Phi3ForCausalLM": tf.Phi3Config(**COMMON, sliding_window=None, pad_token_id=0),
        "SmolLM3ForCausalLM": tf.SmolLM3Config(**COMMON, pad_token_id=0),
        # Mixtures of experts: few experts, so that a decode step of a few tokens leaves some idle.
        # Layer 2 of the Qwen3-MoE is a dense MLP (mlp_only_layers).
        "Qwen3MoeForCausalLM": tf.Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[2],
        ),
        "MixtralForCausalLM": tf.MixtralConfig(
            **COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=16
        ),
        "Qwen2MoeForCausalLM": tf.Qwen2MoeConfig(
            **COMMON,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
        ),
        # One block per layer: Mamba-2 (two groups of B/C, scanned in chunks of 16 tokens),
        # attention, squared-ReLU MLP.
        "NemotronHForCausalLM": tf.NemotronHConfig(
            **{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
            head_dim=16,
            layers_block_type=[
                "linear_attention",
                "full_attention",
                "mlp",
                "linear_attention",
                "mlp",
                "full_attention",
            ],
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=16,
        ),
        # Nemotron 3: MoE blocks of 8 squared-ReLU experts in two groups (each token's best group
        # only), a latent width of 32 and a shared expert; sigmoid router scaled by 2.5.
        "NemotronHForCausalLM-moe": tf.NemotronHConfig(
            **{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
            head_dim=16,
            layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"],
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_latent_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        ),
        # Short convolutions and attention; the MLP width goes through LFM2's 2/3 and rounding
        # (192 -> 128 -> 144). The MoE's layer 0 is dense, the others sparse.
        "Lfm2ForCausalLM": tf.Lfm2Config(
            **{**COMMON, "intermediate_size": 192},
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            block_multiple_of=48,
        ),
        "Lfm2MoeForCausalLM": tf.Lfm2MoeConfig(
            **COMMON,
            layer_types=["conv", "full_attention", "conv", "conv"],
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            routed_scaling_factor=1.5,
            tie_word_embeddings=False,
        ),
        # Gated delta nets (layers 0, 2, 3: two key heads each serving two value heads) beside one
        # gated attention layer with RoPE on half of each head; Qwen3-Next's layer 2 is a dense MLP.
        "Qwen3NextForCausalLM": tf.Qwen3NextConfig(**COMMON, **_DELTA_NET, num_experts=4, **_EXPERTS),
        "Qwen3_5ForCausalLM": tf.Qwen3_5TextConfig(**COMMON, **_DELTA_NET),
        "Qwen3_5MoeForCausalLM": tf.Qwen3_5MoeTextConfig(
            **COMMON,
            **_DELTA_NET,
            num_experts=4,
            **{k: v for k, v in _EXPERTS.items() if k != "mlp_only_layers"},
        ),
        # AFMoE (tests/engine/spread_routers.py gives its zero-initialised routers weights):
        # sliding layers (rotated) and every second layer global (no RoPE), gated attention
        # outputs, sandwich norms, layer 0 dense, sigmoid routing scaled by 2, two shared experts'
        # width, muP-scaled embeddings.
        "AfmoeForCausalLM": tf.AfmoeConfig(
            **COMMON,
            head_dim=16,
            sliding_window=16,
            global_attn_every_n_layers=2,
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_shared_experts=2,
            route_scale=2.0,
            mup_enabled=True,
        ),
        # Step 3.7's text decoder (its vision tower is tiny and unused): sliding layers with twice
        # the query heads, half-rotated full layers, a gate per head; layer 0 dense, then sigmoid
        # routing scaled by 2.5 with a shared expert; SwiGLUs clamped low enough to bite.
        "Step3p7ForConditionalGeneration": tf.Step3p7Config(
            text_config=dict(
                **COMMON,
                head_dim=16,
                sliding_window=16,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                num_sliding_attention_heads=8,
                rope_parameters={
                    "full_attention": {
                        "rope_type": "default",
                        "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5,
                    },
                    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                },
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                n_routed_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                share_expert_dim=48,
                moe_router_scaling_factor=2.5,
                swiglu_limits=[0, 0, 0.1, 0.1],
                swiglu_limits_shared=[0.1, 0.1, 0, 0],
            ),
            vision_config=dict(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
            ),
        ),
        # Post-norm attention layers with their q/k norms across heads; beta in (0, 2).
        "OlmoHybridForCausalLM": tf.OlmoHybridConfig(
            **COMMON,
            **{k: v for k, v in _DELTA_NET.items() if k not in ("head_dim", "rope_parameters")},
            pad_token_id=0,
        ),
        # Mixtures of experts beside dense layers (tests/engine/test_routed_moe_families.py makes
        # their routers decisive). GLM-4.5: layer 0 dense; sigmoid router over 4 groups of 2
        # experts (2 kept), scaled by 2.5; a shared expert; q/k/v biases, q/k norms, half-rotary
        # heads wider than hidden / heads.
        "Glm4MoeForCausalLM": tf.Glm4MoeConfig(
            **COMMON, head_dim=32, attention_bias=True, use_qk_norm=True, **GLM4_MOE_EXPERTS
        ),
        # MiniMax-M2: every layer sparse (experts intermediate_size wide), q/k norms across heads,
        # a quarter of each head rotated (rotary_dim).
        "MiniMaxM2ForCausalLM": tf.MiniMaxM2Config(
            **{**COMMON, "intermediate_size": 32},
            head_dim=32,
            rotary_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        # Ernie 4.5: layers 1 and 2 sparse (start 1, end 2), softmax router with a correction
        # bias, two shared experts; biases everywhere (use_bias); adjacent-pair RoPE; tied head.
        "Ernie4_5_MoeForCausalLM": tf.Ernie4_5_MoeConfig(
            **COMMON,
            use_bias=True,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
        ),
        # dots.llm1: Qwen3 attention with biases, layers 2 and 3 sliding; layer 0 dense; sigmoid
        # router over 2 groups (1 kept), renormalised and scaled by 2; two shared experts.
        "Dots1ForCausalLM": tf.Dots1Config(
            **COMMON,
            head_dim=32,
            attention_bias=True,
            sliding_window=16,
            max_window_layers=2,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
        ),
        # DeepSeek-V3 (tests/engine/tiny_deepseek.py makes its routers decisive): multi-head latent
        # attention with a query LoRA, interleaved RoPE scaled by YaRN (mscale_all_dim: the softmax
        # scale too) and value heads narrower than query/key heads; layer 0 dense, then sigmoid
        # routers over 4 groups of 2 experts (2 kept), scaled by 2.5, and a shared expert.
        "DeepseekV3ForCausalLM": tf.DeepseekV3Config(**{**COMMON, **_LATENT}),
        # ... and without the query LoRA, with rotate-half RoPE, two dense layers, ungrouped
        # unnormalised routing and two shared experts.
        "DeepseekV3ForCausalLM-plain": tf.DeepseekV3Config(
            **{
                **COMMON,
                **_LATENT,
                "q_lora_rank": None,
                "rope_interleave": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "first_k_dense_replace": 2,
                "n_group": 1,
                "topk_group": 1,
                "norm_topk_prob": False,
                "n_shared_experts": 2,
            }
        ),
    }


VARIANTS = [
    "LlamaForCausalLM",
    "LlamaForCausalLM-llama3",
    "LlamaForCausalLM-yarn",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
]


def build_tiny_model(variant: str, directory: Path, seed: int = 0, dtype=torch.float32, config=None):
    """Save a random model of ``variant`` to ``directory``; returns the transformers model.
    ``config``: the transformers config to build it from, where it is not one listed here."""
    import transformers as tf

    config = config if config is not None else _configs()[variant]
    arch = variant.split("-")[0]
    torch.manual_seed(seed)
    model = getattr(tf, arch)(config).to(dtype).eval()
    # Random init leaves norms at 1, biases at 0 and learned activations (xIELU's) alike in every
    # layer: perturb them so their handling is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or ".act_fn." in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model
