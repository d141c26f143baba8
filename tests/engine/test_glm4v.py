"""GLM-4.1V and GLM-4.5V against transformers on tiny random models (tiny_glm4v.py): GLM-4V's vision
tower (its position table resampled to each grid, strided-convolution merge, projector) in front
of the GLM-4 decoder (sandwich norms, adjacent-pair RoPE) or the GLM-4.5 one (mixtures of experts
behind a dense first layer), both rotating half of each head by M-RoPE sections. Text alone, one
and two images, and the Generator decoding after an image; GLM-4V's image sizing rule against
transformers'; and the decoder settings a config may leave out."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from PIL import Image
from tiny_glm4v import GLM4V, GLM4V_MOE, VARIANTS, build_tiny_glm4v
from vision_reply import assert_replies_follow_reference

from engine.architectures import architecture_for
from engine.cache.paged import PagedKVCache
from engine.config import ModelConfig
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.mrope import MultimodalRotaryEmbedding
from engine.tokenizer import Tokenizer
from engine.vision.glm4v import Glm4vImageProcessing
from engine.vision.processor_config import ImageSettings
from engine.vision.prompt import encode_chat_with_images, user_message

TOL = 1e-4  # with images too (the issue asks for 1e-3 there)


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = {"one": [_image(30, 45, 1)], "two": [_image(30, 45, 1), _image(61, 22, 2)]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``variant -> (directory, our model, transformers' model, its processor)``, built once."""
    built = {}

    def get(variant: str):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant)
            reference, processor = build_tiny_glm4v(variant, directory)
            built[variant] = (directory, load_model(directory, device="cpu"), reference, processor)
        return built[variant]

    return get


def _image_prompt(processor, pictures):
    messages = [user_message("What is in these pictures?", len(pictures))]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return messages, processor(text=text, images=pictures, return_tensors="pt")


def test_glm4v_decoder_layers_are_glm4s_with_multimodal_rope(models):
    _, model, _, _ = models(GLM4V)
    assert model.vision is not None
    for block in model.module.blocks:
        attention = block.mixer
        assert block.mixer_out_norm is not None and block.feed_forward_out_norm is not None
        assert all(linear.bias is not None for linear in attention.qkv.linears)  # always, in GLM-4V
        assert attention.o_proj.bias is None
        rope = attention.rope
        assert isinstance(rope, MultimodalRotaryEmbedding) and not rope.interleaved
        assert (rope.rotary_dim, rope.adjacent_pairs, rope.sections) == (16, True, [2, 3, 3])


def test_glm4v_moe_decoder_layers_are_glm45s_with_multimodal_rope(models):
    _, model, _, _ = models(GLM4V_MOE)
    blocks = model.module.blocks
    assert model.vision is not None
    assert isinstance(blocks[0].feed_forward, GatedMLP)  # first_k_dense_replace
    for block in blocks[1:]:
        moe = block.feed_forward
        assert isinstance(moe, SparseMoE)
        assert (moe.scoring, moe.top_k, (moe.num_groups, moe.groups_per_token)) == ("sigmoid", 3, (4, 2))
        assert moe.scale == 2.5 and moe.normalize and moe.selection_bias is not None
        assert moe.shared is not None
    for block in blocks:
        attention = block.mixer
        assert block.mixer_out_norm is None and attention.q_norm is None
        rope = attention.rope
        assert isinstance(rope, MultimodalRotaryEmbedding) and not rope.interleaved
        assert (rope.rotary_dim, rope.adjacent_pairs, rope.sections) == (16, False, [2, 3, 3])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [20, 64])
def test_text_logits_match_transformers(variant, chunk, models):
    """64 tokens prefilled at once or in pieces of 20 (across the cache's 16-token pages)."""
    _, model, reference, _ = models(variant)
    ids = random_ids(64, seed=1)
    expected = reference_logits(reference, ids)
    got = score_tokens(model.module, PagedKVCache.for_model(model.spec, 256, page_size=16), ids, chunk=chunk)
    err = rel_err(got, expected)
    print(f"{variant} text, chunk {chunk}: relative error {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("images", IMAGES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_with_images_match_transformers(variant, images, models):
    directory, model, reference, processor = models(variant)
    pictures = IMAGES[images]
    messages, inputs = _image_prompt(processor, pictures)
    with torch.no_grad():
        expected = reference(**inputs).logits[0].float()
    ids, media = encode_chat_with_images(Tokenizer.from_dir(directory), model.vision, messages, pictures)
    assert ids == inputs["input_ids"][0].tolist()
    cache = PagedKVCache.for_model(model.spec, 512, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=24, media=media)  # chunks cut through images
    err = rel_err(got, expected)
    print(f"{variant} {images} image(s): relative error {err:.2e} over {len(ids)} tokens")
    assert err < TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_generator_decodes_after_an_image_as_transformers_scores(variant, models):
    """A greedy reply to a prompt with an image (prefilled in chunks of 20 that cut through it,
    pages of 16) beside a text-only job: each reply token is what transformers' logits choose,
    its M-RoPE positions continuing after the image."""
    directory, model, reference, processor = models(variant)
    pictures = IMAGES["one"]
    messages, inputs = _image_prompt(processor, pictures)
    tokenizer = Tokenizer.from_dir(directory)
    ids, media = encode_chat_with_images(tokenizer, model.vision, messages, pictures)
    text_only = random_ids(13, seed=5)
    assert_replies_follow_reference(model, tokenizer, reference, inputs, ids, media, text_only)


@pytest.mark.parametrize(
    "size", [(30, 45), (61, 22), (5, 40), (3, 3), (7, 300), (600, 13), (200, 201), (1000, 999)]
)
def test_image_sizes_follow_glm4vs_rule(size):
    """Resized sizes as transformers' GLM-4V processor computes them: small sides enlarged first,
    the pixel bounds counting the two frames of a temporal patch."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    settings = ImageSettings({"size": {"shortest_edge": 4 * 64, "longest_edge": 40 * 64}})
    processing = Glm4vImageProcessing(settings, patch=4, merge=2, temporal=2, mean=[0.48145466] * 3)
    height, width = size
    expected = smart_resize(2, height, width, temporal_factor=2, factor=8, min_pixels=256, max_pixels=2560)
    assert processing.fit(height, width) == expected


def test_glm4v_decoder_defaults_where_the_config_is_silent(models, tmp_path):
    """Without ``partial_rotary_factor`` transformers' GLM-4V turns the whole head (GLM-4's half
    is not its default), and without ``mrope_section`` it uses sections 8, 12, 12."""
    directory, _, _, _ = models(GLM4V)
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config["text_config"]["rope_parameters"]
    del rope["partial_rotary_factor"], rope["mrope_section"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(tmp_path)
    attention = architecture_for(cfg.architecture).spec(cfg).layers[0].mixer
    assert attention.rope.partial_rotary_factor == 1.0
    assert attention.rope.params["mrope_section"] == [8, 12, 12]
    assert attention.rope.adjacent_pairs
