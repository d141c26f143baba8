"""A tiny random Gemma4ForConditionalGeneration with its tokenizer, chat template, image
processor settings and transformers' processor, assembled offline (tests/vision's byte-level
tokenizer plus Gemma 4's special tokens from id 256 on).

The vision tower cuts 4-pixel patches and pools squares of 2 x 2 into a soft token, so the
smallest budget of soft tokens (70) allows 280 patches: a 30 x 45 image becomes 48 x 80 pixels,
60 soft tokens. The chat template is a reduction of Gemma 4's to its turn markers and its image
marker ``<|image|>``, which the processor expands to ``<|image>``, one ``<|image|>`` per soft
token and ``<image|>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tiny_gemma4 import perturb, text_config

sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))
from tiny_processors import _byte_tokenizer, _skip_processor_class_checks  # noqa: E402

SPECIALS = [
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>",
    "<|video|>", "<|audio>", "<audio|>", "<|audio|>",
]  # fmt: skip
ROLES = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
EXTRA = dict(
    boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>",
    boa_token="<|audio>", eoa_token="<audio|>", audio_token="<|audio|>",
)  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}{% elif part['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<turn|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)
IMAGES = dict(
    image_processor_type="Gemma4ImageProcessor",
    patch_size=4,
    max_soft_tokens=70,
    pooling_kernel_size=2,
    resample=3,
    rescale_factor=1 / 255,
    do_normalize=False,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=64,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)


def special_id(token: str) -> int:
    return 256 + SPECIALS.index(token)


def build_tiny_gemma4_vlm(layout: str, directory: Path, seed: int = 0):
    """The tiny VLM with the text decoder of ``layout`` (tests/engine/tiny_gemma4.py) saved with
    its processor files to ``directory``; returns transformers' model and processor."""
    import transformers as tf

    text = text_config(
        layout,
        pad_token_id=special_id("<pad>"),
        bos_token_id=special_id("<bos>"),
        eos_token_id=special_id("<eos>"),
    )
    config = tf.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=VISION,
        image_token_id=special_id("<|image|>"),
        boi_token_id=special_id("<|image>"),
        eoi_token_id=special_id("<image|>"),
        video_token_id=special_id("<|video|>"),
        audio_token_id=special_id("<|audio|>"),
        boa_token_id=special_id("<|audio>"),
        eoa_token_index=special_id("<audio|>"),
    )
    torch.manual_seed(seed)
    model = tf.Gemma4ForConditionalGeneration(config).float().eval()
    perturb(model)
    with torch.no_grad():  # the tower's position tables start at 1 everywhere
        table = model.model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    _byte_tokenizer(SPECIALS).save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **ROLES, **EXTRA}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "preprocessor_config.json").write_text(json.dumps(IMAGES, indent=1))
    return model, hf_processor(directory)


def hf_processor(directory: Path):
    """transformers' Gemma4Processor for the tiny model, with the Pillow image processor."""
    import transformers as tf

    _skip_processor_class_checks()
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), **ROLES, extra_special_tokens=EXTRA
    )
    settings = {k: v for k, v in IMAGES.items() if k != "image_processor_type"}
    return tf.Gemma4Processor(
        None,
        tf.Gemma4ImageProcessorPil(**settings),
        tokenizer,
        None,
        chat_template=TEMPLATE,
        image_seq_length=70,
    )
