"""Qwen3.5 and Qwen3.5-MoE with images: Qwen3-VL's vision tower without its deepstack mergers in
front of the gated-delta-net decoder, against transformers on tiny random models."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))
from tiny_models import _DELTA_NET  # noqa: E402
from tiny_processors import hf_processor, special_id, write_processor_files  # noqa: E402
from tiny_vlms import TEXT  # noqa: E402

from engine.cache.paged import PagedKVCache  # noqa: E402
from engine.generation.step import score_tokens  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.vision.prompt import encode_chat_with_images, user_message  # noqa: E402

EXPERTS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)
# Qwen3-VL's processor and chat template serve Qwen3.5 (its checkpoints ship the same).
PROCESSOR_OF = "Qwen3VLForConditionalGeneration"


def _tiny_vlm(arch: str, directory: Path):
    import transformers as tf

    text = dict(
        **{**TEXT, "num_hidden_layers": 4},
        **_DELTA_NET,
        bos_token_id=special_id("qwen", "<|endoftext|>"),
        eos_token_id=special_id("qwen", "<|im_end|>"),
    )
    # Multimodal RoPE over the 4 rotated pairs of each head (half of 16 dims), interleaved.
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    if "Moe" in arch:
        text.update(EXPERTS)
    config_class = tf.Qwen3_5MoeConfig if "Moe" in arch else tf.Qwen3_5Config
    config = config_class(
        text_config=text,
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
        ),
        image_token_id=special_id("qwen", "<|image_pad|>"),
        video_token_id=special_id("qwen", "<|video_pad|>"),
        vision_start_token_id=special_id("qwen", "<|vision_start|>"),
        vision_end_token_id=special_id("qwen", "<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = getattr(tf, arch)(config).float().eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide their handling
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    write_processor_files(PROCESSOR_OF, model.config, directory)
    return model, hf_processor(PROCESSOR_OF, model.config, directory)


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("arch", ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"])
def test_logits_with_images_match_transformers(arch, tmp_path):
    reference, processor = _tiny_vlm(arch, tmp_path)
    pictures = [_image(30, 45, 1), _image(61, 22, 2)]
    messages = [user_message("What is in these pictures?", len(pictures))]
    inputs = processor(
        text=processor.apply_chat_template(messages, add_generation_prompt=True),
        images=pictures,
        return_tensors="pt",
    )
    with torch.no_grad():
        expected = reference(**inputs).logits[0].float()

    model = load_model(tmp_path, device="cpu")
    assert model.vision is not None
    ids, media = encode_chat_with_images(Tokenizer.from_dir(tmp_path), model.vision, messages, pictures)
    assert ids == inputs["input_ids"][0].tolist()
    cache = PagedKVCache.for_model(model.spec, 512, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=24, media=media)  # chunks cut through images
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4
