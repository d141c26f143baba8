"""Tiny random GLM-4.1V and GLM-4.5V models (Glm4vForConditionalGeneration,
Glm4vMoeForConditionalGeneration) built with transformers, with the tiny processor files of
tests/vision, for the families' parity, conversion and GPU tests; and where ExLlamaV3 keeps their
quantized linears."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))
from tiny_models import GLM4_MOE_EXPERTS  # noqa: E402  (beside this file)
from tiny_processors import hf_processor, special_id, write_processor_files  # noqa: E402
from tiny_vlms import TEXT  # noqa: E402

GLM4V, GLM4V_MOE = "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"
VARIANTS = [GLM4V, GLM4V_MOE]

# Half of each 32-wide head rotated: 8 pairs, in t/h/w sections of 2, 3 and 3.
ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [2, 3, 3],
    "partial_rotary_factor": 0.5,
}

# A 32-wide tower of 4 heads over 4 x 4 patches merged 2 x 2; its learned position table is 8 x 8
# (image_size / patch_size), which every image's grid resamples; q/k/v biases.
VISION = dict(
    depth=2,
    hidden_size=32,
    num_heads=4,
    intermediate_size=48,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    image_size=32,
    attention_bias=True,
)

ROUTER_GAIN = 10.0  # router logits spread by ~1.6: no expert choice hangs on rounding


def _config(variant: str):
    import transformers as tf

    ids = dict(
        image_token_id=special_id("glm4v", "<|image|>"),
        video_token_id=special_id("glm4v", "<|video|>"),
        image_start_token_id=special_id("glm4v", "<|begin_of_image|>"),
        image_end_token_id=special_id("glm4v", "<|end_of_image|>"),
        video_start_token_id=special_id("glm4v", "<|begin_of_video|>"),
        video_end_token_id=special_id("glm4v", "<|end_of_video|>"),
    )
    text = dict(
        **TEXT,
        rope_parameters=ROPE,
        eos_token_id=special_id("glm4v", "<|user|>"),
        pad_token_id=special_id("glm4v", "<|endoftext|>"),
    )
    if variant == GLM4V:
        # Heads of hidden / heads = 32 (GLM-4V's decoder reads no head_dim).
        text |= dict(num_attention_heads=2, num_key_value_heads=1)
        return tf.Glm4vConfig(text_config=text, vision_config=VISION, **ids)
    # Heads wider than hidden / heads; q/k/v biases; GLM-4.5's mixtures of experts.
    text |= dict(num_hidden_layers=3, head_dim=32, attention_bias=True, **GLM4_MOE_EXPERTS)
    return tf.Glm4vMoeConfig(text_config=text, vision_config=VISION, **ids)


def build_tiny_glm4v(variant: str, directory: Path, seed: int = 0):
    """A tiny ``variant`` saved to ``directory`` with its processor files; returns the
    transformers model and processor. Norms and biases are perturbed (at 1 and 0 they would hide
    their handling) and the tower's position table made to matter; the MoE's routers are made
    decisive and their correction biases random."""
    import transformers as tf

    torch.manual_seed(seed)
    model = getattr(tf, variant)(_config(variant)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(".bias"):
                t.add_(torch.randn(t.shape, generator=gen) * 0.1)
            elif name.endswith("position_embedding.weight"):  # as large as the patches' embeddings
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                t.mul_(ROUTER_GAIN)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    model.save_pretrained(directory, safe_serialization=True)
    write_processor_files(variant, model.config, directory)
    return model, hf_processor(variant, model.config, directory)


def exllamav3_linears(config: dict) -> dict[str, tuple[int, int]]:
    """``key -> (in, out)`` of every linear ExLlamaV3 quantizes in a model of ``config`` (the
    decoder under ``model.language_model.``: q/k/v/o, GLM-4's gate_up_proj as gate_proj and
    up_proj, each routed expert and the shared expert one by one; and the head). The vision
    tower stays unquantized."""
    text = config["text_config"]
    h, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    d = text.get("head_dim") or h // heads
    out: dict[str, tuple[int, int]] = {"lm_head": (h, text["vocab_size"])}
    dense = text.get("first_k_dense_replace", text["num_hidden_layers"])
    for i in range(text["num_hidden_layers"]):
        p = f"model.language_model.layers.{i}."
        out |= {p + "self_attn.q_proj": (h, heads * d), p + "self_attn.o_proj": (heads * d, h)}
        out |= {p + "self_attn.k_proj": (h, kv * d), p + "self_attn.v_proj": (h, kv * d)}
        if i < dense:
            mlps, f = ["mlp."], text["intermediate_size"]
        else:
            experts = [f"mlp.experts.{e}." for e in range(text["n_routed_experts"])]
            mlps, f = [*experts, "mlp.shared_experts."], text["moe_intermediate_size"]
        for m in mlps:
            out |= {p + m + "gate_proj": (h, f), p + m + "up_proj": (h, f), p + m + "down_proj": (f, h)}
    return out
