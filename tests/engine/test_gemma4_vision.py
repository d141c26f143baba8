"""Gemma 4 with images against transformers on tiny random models (tests/engine/tiny_gemma4_vlm.py):
the 31B's decoder (an image's tokens see each other in its sliding layers) and the E2B's (its
per-layer inputs read the padding token's row at image positions; shared keys and values), one
and two images of other aspect ratios than the tower's; and audio, refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity import rel_err
from PIL import Image
from tiny_gemma4_vlm import build_tiny_gemma4_vlm

from engine.cache.paged import PagedKVCache
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.tokenizer import Tokenizer
from engine.vision.gemma4 import Gemma4Vision, fit_size
from engine.vision.prompt import AudioInputError, encode_chat_with_images, encode_with_images, user_message

TOL = 1e-3


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = {"one": [_image(30, 45, 1)], "two": [_image(30, 45, 1), _image(61, 22, 2)]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``layout -> (directory, our model, transformers' model, its processor)``."""
    built = {}

    def get(layout: str):
        if layout not in built:
            directory = tmp_path_factory.mktemp(f"gemma4-vl-{layout}")
            reference, processor = build_tiny_gemma4_vlm(layout, directory)
            built[layout] = (directory, load_model(directory, device="cpu"), reference, processor)
        return built[layout]

    return get


def _prompt(processor, pictures):
    messages = [user_message("What is in these pictures?", len(pictures))]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return messages, processor(text=text, images=pictures, return_tensors="pt")


@pytest.mark.parametrize("images", list(IMAGES))
@pytest.mark.parametrize("layout", ["31b", "e2b"])
def test_logits_with_images_match_transformers(tiny, layout, images):
    directory, model, reference, processor = tiny(layout)
    pictures = IMAGES[images]
    messages, inputs = _prompt(processor, pictures)
    with torch.no_grad():
        expected = reference(**inputs).logits[0].float()
    assert isinstance(model.vision, Gemma4Vision) and model.vision.bidirectional == (layout == "31b")
    ids, media = encode_chat_with_images(Tokenizer.from_dir(directory), model.vision, messages, pictures)
    assert ids == inputs["input_ids"][0].tolist()
    cache = PagedKVCache.for_model(model.spec, 512, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=24, media=media)  # chunks cut through images
    err = rel_err(got, expected)
    print(f"gemma4 {layout} {images} image(s): relative error {err:.2e} over {len(ids)} tokens")
    assert err < TOL


def test_the_image_specifics_are_in_play(tiny):
    """An image's tokens seeing each other (31B) and the padding row of the per-layer inputs at
    image positions (E2B) each move the logits far beyond the tolerance."""
    pictures = IMAGES["two"]
    for layout, change in (("31b", "bidirectional"), ("e2b", "pad")):
        directory, model, reference, processor = tiny(layout)
        messages, inputs = _prompt(processor, pictures)
        with torch.no_grad():
            expected = reference(**inputs).logits[0].float()
        ids, media = encode_chat_with_images(Tokenizer.from_dir(directory), model.vision, messages, pictures)
        inputs_module = model.module.per_layer_inputs
        if change == "bidirectional":
            media.bidirectional = False
        else:
            saved = inputs_module.pad_token_id
            inputs_module.pad_token_id = model.vision.image_token_id  # as if the placeholder were looked up
        try:
            got = score_tokens(
                model.module, PagedKVCache.for_model(model.spec, 512, page_size=16), ids, media=media
            )
        finally:
            if change == "pad":
                inputs_module.pad_token_id = saved
        assert rel_err(got, expected) > 10 * TOL, layout


def test_image_sizes_follow_the_processor(tiny):
    """The resized size and soft-token count of each image are the processor's."""
    _, model, _, processor = tiny("31b")
    for picture in (*IMAGES["two"], _image(3, 200, 3), _image(200, 5, 4), _image(512, 512, 5)):
        prepared = model.vision.prepare(picture)
        theirs = processor.image_processor(picture, return_tensors="pt")
        assert prepared.pixels.shape[0] == int((theirs["image_position_ids"][0, :, 0] >= 0).sum())
        tokens = prepared.grid[0] * prepared.grid[1] // 4
        assert tokens == int(theirs["num_soft_tokens_per_image"][0])
        torch.testing.assert_close(prepared.pixels, theirs["pixel_values"][0, : prepared.pixels.shape[0]])
    assert fit_size(30, 45, 4, 280, 2) == (48, 80)


def test_audio_is_refused_by_name(tiny):
    directory, model, _, _ = tiny("e2b")
    tokenizer = Tokenizer.from_dir(directory)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    with pytest.raises(AudioInputError, match="Gemma 4's audio input is not supported"):
        encode_chat_with_images(tokenizer, model.vision, messages, [])
    assert model.vision.audio_marker == "<|audio|>"
    with pytest.raises(AudioInputError, match="<\\|audio\\|>"):
        encode_with_images(tokenizer, model.vision, "<|turn>user\n<|audio|>Transcribe.<turn|>\n", [])
