"""A tiny random Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration) built with transformers, with
the tiny processor files of tests/vision, for the family's parity and conversion tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))
from tiny_processors import hf_processor, special_id, write_processor_files  # noqa: E402
from tiny_vlms import TEXT  # noqa: E402

# Qwen3-VL's processor and chat template serve Qwen3-VL-MoE (its checkpoints ship the same).
PROCESSOR_OF = "Qwen3VLForConditionalGeneration"
# An expert 24 wide: its fused gate_up_proj (48 rows) and down_proj are not square, so their
# transposed layout (Qwen's checkpoints) is told apart from transformers' by shape.
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[2])


def build_tiny_qwen3_vl_moe(directory: Path):
    """A tiny Qwen3-VL-MoE saved to ``directory``, its routers spread (logits ~1.6 apart) so that
    no expert choice hangs on rounding; returns the transformers model and processor."""
    import transformers as tf

    config = tf.Qwen3VLMoeConfig(
        text_config=dict(
            **{**TEXT, "num_hidden_layers": 4},
            **EXPERTS,
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
        image_token_id=special_id("qwen", "<|image_pad|>"),
        video_token_id=special_id("qwen", "<|video_pad|>"),
        vision_start_token_id=special_id("qwen", "<|vision_start|>"),
        vision_end_token_id=special_id("qwen", "<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = tf.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms at 1 and biases at 0 would hide their handling
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    write_processor_files(PROCESSOR_OF, model.config, directory)
    return model, hf_processor(PROCESSOR_OF, model.config, directory)
