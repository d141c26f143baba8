"""Our logits against transformers' for prompts with images, on tiny random VLMs of every
supported family (issue 8, acceptance 1)."""

import numpy as np
import pytest
import torch
from parity import rel_err
from PIL import Image
from tiny_vlms import VL_ARCHITECTURES

from engine.cache.paged import PagedKVCache
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.tokenizer import Tokenizer
from engine.vision.prompt import encode_chat_with_images, user_message

TOL = 1e-3


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGE_SETS = {
    "one": [random_image(30, 45, 1)],
    "two": [random_image(30, 45, 1), random_image(61, 22, 2)],
}


@pytest.mark.parametrize("images", IMAGE_SETS, ids=str)
@pytest.mark.parametrize("arch", VL_ARCHITECTURES)
def test_logits_match_transformers(arch, images, tiny_vlm_factory, record_property):
    directory, reference, processor = tiny_vlm_factory(arch)
    pictures = IMAGE_SETS[images]
    messages = [user_message("What is in these pictures?", len(pictures))]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=pictures, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).logits[0].float()

    model = load_model(directory, device="cpu")
    tokenizer = Tokenizer.from_dir(directory)
    ids, media = encode_chat_with_images(tokenizer, model.vision, messages, pictures)
    assert ids == inputs["input_ids"][0].tolist()
    cache = PagedKVCache.for_model(model.spec, 512, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=24, media=media)  # chunks cut through images
    err = rel_err(got, expected)
    record_property("rel_err", err)
    print(f"{arch} {images}: relative error {err:.2e} over {len(ids)} tokens")
    assert err < TOL
