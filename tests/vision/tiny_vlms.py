"""Tiny random vision-language models, built with transformers' own config classes.

Every family gets the same small text decoder shape and a small vision tower whose patch grid
is a few cells wide, so an image costs a handful of tokens and a test runs in seconds. The
special image tokens sit inside the 320-entry vocabulary, after the 256 byte tokens of the
tiny tokenizer (``tiny_processors.py``) and its chat tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

# Special-token ids of the tiny tokenizer, per family (see tiny_processors.SPECIALS).
SPECIAL_BASE = 256


def _configs():
    import transformers as tf
    from tiny_processors import special_id

    gemma3 = tf.Gemma3Config(
        text_config=tf.Gemma3TextConfig(
            **{**TEXT, "num_hidden_layers": 3},
            head_dim=16,
            sliding_window=8,
            sliding_window_pattern=3,
            query_pre_attn_scalar=16,
            bos_token_id=special_id("gemma3", "<bos>"),
            eos_token_id=special_id("gemma3", "<eos>"),
            pad_token_id=special_id("gemma3", "<pad>"),
        ),
        vision_config=tf.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=28,
            patch_size=7,
        ),
        mm_tokens_per_image=4,
        image_token_index=special_id("gemma3", "<image_soft_token>"),
        boi_token_index=special_id("gemma3", "<start_of_image>"),
        eoi_token_index=special_id("gemma3", "<end_of_image>"),
    )
    qwen_ids = dict(
        image_token_id=special_id("qwen", "<|image_pad|>"),
        video_token_id=special_id("qwen", "<|video_pad|>"),
        vision_start_token_id=special_id("qwen", "<|vision_start|>"),
        vision_end_token_id=special_id("qwen", "<|vision_end|>"),
    )
    qwen25 = tf.Qwen2_5_VLConfig(
        text_config=dict(
            **TEXT,
            model_type="qwen2_5_vl_text",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=special_id("qwen", "<|endoftext|>"),
            eos_token_id=special_id("qwen", "<|im_end|>"),
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=16,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        **qwen_ids,
    )
    qwen3 = tf.Qwen3VLConfig(
        text_config=dict(
            **TEXT,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            bos_token_id=special_id("qwen", "<|endoftext|>"),
            eos_token_id=special_id("qwen", "<|im_end|>"),
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        **qwen_ids,
    )
    mistral3 = tf.Mistral3Config(
        text_config=tf.MistralConfig(
            **TEXT,
            head_dim=16,
            bos_token_id=special_id("mistral3", "<s>"),
            eos_token_id=special_id("mistral3", "</s>"),
        ),
        vision_config=tf.PixtralVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=64,
            patch_size=4,
        ),
        image_token_index=special_id("mistral3", "[IMG]"),
        spatial_merge_size=2,
    )
    return {
        "Gemma3ForConditionalGeneration": gemma3,
        "Qwen2_5_VLForConditionalGeneration": qwen25,
        "Qwen3VLForConditionalGeneration": qwen3,
        "Mistral3ForConditionalGeneration": mistral3,
    }


VL_ARCHITECTURES = [
    "Gemma3ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
]


def build_tiny_vlm(arch: str, directory: Path, seed: int = 0):
    """Save a random ``arch`` model to ``directory``; returns the transformers model."""
    import transformers as tf

    config = _configs()[arch]
    torch.manual_seed(seed)
    model = getattr(tf, arch)(config).float().eval()
    # Random init leaves norms at 1, biases and some projections at 0: perturb them all so their
    # handling is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or "mm_input_projection" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model
