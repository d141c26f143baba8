"""Qwen3-VL-MoE against transformers on a tiny random model: Qwen3-VL's deepstack vision tower in
front of a Qwen3 decoder whose MLPs are mixtures of experts (one layer dense), with and without
images; the Generator's decode over the paged cache with an image in the prompt; and the experts
as Qwen's own checkpoints store them (fused and transposed)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from parity import rel_err
from PIL import Image
from safetensors.torch import load_file, save_file
from spread_routers import smallest_margin
from tiny_qwen3_vl_moe import build_tiny_qwen3_vl_moe
from vision_reply import assert_replies_follow_reference

from engine.cache.paged import PagedKVCache
from engine.errors import ModelLoadError
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.tokenizer import Tokenizer
from engine.vision.prompt import encode_chat_with_images, user_message

TOL = 1e-4


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(directory, our model, transformers' model, its processor)``."""
    directory = tmp_path_factory.mktemp("qwen3_vl_moe")
    reference, processor = build_tiny_qwen3_vl_moe(directory)
    return directory, load_model(directory, device="cpu"), reference, processor


def _image_prompt(processor, pictures):
    messages = [user_message("What is in these pictures?", len(pictures))]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return messages, processor(text=text, images=pictures, return_tensors="pt")


def test_the_decoder_is_qwen3_vl_with_experts(tiny):
    _, model, reference, _ = tiny
    blocks = model.module.blocks
    assert model.vision is not None
    assert isinstance(blocks[2].feed_forward, GatedMLP)  # mlp_only_layers
    moes = [blocks[i].feed_forward for i in (0, 1, 3)]
    assert all(isinstance(m, SparseMoE) for m in moes)
    moe = moes[0]
    assert (moe.scoring, moe.normalize, moe.top_k, moe.shared) == ("softmax", True, 2, None)
    assert len(moe.experts) == 8 and moe.experts[0].down.in_features == 24
    experts = reference.model.language_model.layers[0].mlp.experts
    torch.testing.assert_close(moe.experts[5].down.weight, experts.down_proj[5])
    torch.testing.assert_close(moe.experts[5].gate_up.linears[1].weight, experts.gate_up_proj[5, 24:])


@pytest.mark.parametrize("chunk", [20, 512])
def test_text_logits_match_transformers(tiny, chunk):
    _, model, reference, _ = tiny
    ids = _ids(64, seed=1)
    assert smallest_margin(model, ids) > 1e-5
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float()
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    assert rel_err(score_tokens(model.module, cache, ids, chunk=chunk), expected) < TOL


def test_logits_with_images_match_transformers(tiny):
    directory, model, reference, processor = tiny
    pictures = [_image(30, 45, 1), _image(61, 22, 2)]
    messages, inputs = _image_prompt(processor, pictures)
    with torch.no_grad():
        expected = reference(**inputs).logits[0].float()
    ids, media = encode_chat_with_images(Tokenizer.from_dir(directory), model.vision, messages, pictures)
    assert ids == inputs["input_ids"][0].tolist()
    assert len(ids) >= 64
    cache = PagedKVCache.for_model(model.spec, 512, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=24, media=media)  # chunks cut through images
    assert rel_err(got, expected) < TOL


def test_the_generator_decodes_after_an_image_as_transformers_scores(tiny):
    """A greedy reply to a prompt with an image (prefilled in chunks of 20 that cut through it,
    pages of 16) beside a text-only job: each reply token is what transformers' logits choose,
    its M-RoPE positions continuing after the image."""
    directory, model, reference, processor = tiny
    pictures = [_image(30, 45, 1)]
    messages, inputs = _image_prompt(processor, pictures)
    tokenizer = Tokenizer.from_dir(directory)
    ids, media = encode_chat_with_images(tokenizer, model.vision, messages, pictures)
    text_only = _ids(13, seed=5)
    assert_replies_follow_reference(model, tokenizer, reference, inputs, ids, media, text_only)


def test_qwens_transposed_expert_tensors_load_alike(tiny, tmp_path):
    """Qwen's own checkpoints store each layer's fused experts as ``x @ W`` matrices
    (``gate_up_proj`` [experts, hidden, 2 * f], ``down_proj`` [experts, f, hidden]); transformers
    transposes them when loading, and so do we."""
    directory, model, _, _ = tiny
    target = tmp_path / "qwen-layout"
    shutil.copytree(directory, target)
    tensors = load_file(str(target / "model.safetensors"))
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 6  # three sparse layers
    for key in fused:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    transposed = load_model(target, device="cpu")
    ids = _ids(40, seed=9)
    expected = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), ids)
    got = score_tokens(transposed.module, PagedKVCache.for_model(transposed.spec, 64, page_size=16), ids)
    assert torch.equal(got, expected)


def test_a_fused_expert_tensor_of_another_shape_is_named(tiny, tmp_path):
    directory, _, _, _ = tiny
    target = tmp_path / "damaged"
    shutil.copytree(directory, target)
    tensors = load_file(str(target / "model.safetensors"))
    key = "model.language_model.layers.1.mlp.experts.down_proj"
    tensors[key] = tensors[key][:, :, :20].contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=key):
        load_model(target, device="cpu")
