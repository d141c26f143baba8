"""Images through the generator: chunked prefill around bidirectional image spans, M-RoPE
positions while decoding, prefix reuse keyed by image content, encoding each image once; and
the ``logits``/``generate`` commands with ``--image``."""

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from engine.cli import main as cli_main
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.tokenizer import Tokenizer
from engine.vision.prompt import encode_chat_with_images, user_message


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


PICTURES = [random_image(30, 45, 1), random_image(61, 22, 2)]
QUESTION = "What is in these pictures?"


@pytest.mark.parametrize("arch", ["Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_greedy_generation_matches_transformers(arch, tiny_vlm_factory):
    directory, reference, processor = tiny_vlm_factory(arch)
    messages = [user_message(QUESTION, len(PICTURES))]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=PICTURES, return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()

    model = load_model(directory, device="cpu")
    tokenizer = Tokenizer.from_dir(directory)
    ids, media = encode_chat_with_images(tokenizer, model.vision, messages, PICTURES)
    # Small pages and chunks: prefill chunks meet the image spans, pages split images.
    generator = Generator(model, tokenizer, cache_tokens=512, page_size=16, max_chunk_tokens=20)
    (result,) = generator.generate([Job(ids, max_new_tokens=6, stop_token_ids=[], media=media)])
    assert result.token_ids == expected


def test_prefix_reuse_is_keyed_by_image_content(tiny_vlm_factory):
    directory, _, _ = tiny_vlm_factory("Qwen2_5_VLForConditionalGeneration")
    model = load_model(directory, device="cpu")
    tokenizer = Tokenizer.from_dir(directory)
    generator = Generator(model, tokenizer, cache_tokens=1024, page_size=16)
    messages = [user_message(QUESTION, 1)]

    ids, media = encode_chat_with_images(tokenizer, model.vision, messages, [PICTURES[0]])
    first = generator.generate([Job(ids, max_new_tokens=3, stop_token_ids=[], media=media)])[0]
    assert first.cached_tokens == 0
    calls = model.vision.encode_calls

    # The same picture again (a new PIL object, same pixels): not encoded again, pages reused.
    again = PICTURES[0].copy()
    ids2, media2 = encode_chat_with_images(tokenizer, model.vision, messages, [again])
    assert model.vision.encode_calls == calls
    second = generator.generate([Job(ids2, max_new_tokens=3, stop_token_ids=[], media=media2)])[0]
    assert second.cached_tokens >= (len(ids) - 1) // 16 * 16
    assert second.token_ids == first.token_ids

    # A different picture of the same size: same token ids, but only the pages before it match.
    other = random_image(30, 45, 99)
    ids3, media3 = encode_chat_with_images(tokenizer, model.vision, messages, [other])
    assert ids3 == ids
    third = generator.generate([Job(ids3, max_new_tokens=3, stop_token_ids=[], media=media3)])[0]
    image_start = int(media3.images[0].positions[0])
    assert third.cached_tokens <= image_start


def test_logits_command_with_images(tiny_vlm_factory, tmp_path):
    arch = "Mistral3ForConditionalGeneration"
    directory, reference, processor = tiny_vlm_factory(arch)
    paths = []
    for i, picture in enumerate(PICTURES):
        paths += ["--image", str(tmp_path / f"picture{i}.png")]
        picture.save(paths[-1])
    out = tmp_path / "logits.safetensors"
    code = cli_main(["logits", "-m", str(directory), "--device", "cpu", "--chat", "-p", QUESTION, *paths,
                     "--out", str(out)])  # fmt: skip
    assert code == 0
    saved = load_file(out)
    text = processor.apply_chat_template([user_message(QUESTION, 2)], add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(p) for p in paths[1::2]], return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).logits[0]
    assert saved["input_ids"].tolist() == inputs["input_ids"][0].tolist()
    assert ((saved["logits"] - expected).norm() / expected.norm()).item() < 1e-3


def test_image_for_a_text_only_model_is_a_clear_error(tiny_vlm_factory, tmp_path, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "engine"))
    from tiny_models import build_tiny_model

    build_tiny_model("LlamaForCausalLM", tmp_path / "llama")
    directory, _, _ = tiny_vlm_factory("Qwen2_5_VLForConditionalGeneration")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "llama" / name).write_bytes((directory / name).read_bytes())
    picture = tmp_path / "p.png"
    PICTURES[0].save(picture)
    with pytest.raises(SystemExit, match="cannot see images"):
        cli_main(["logits", "-m", str(tmp_path / "llama"), "--device", "cpu", "--chat", "-p", "hi",
                  "--image", str(picture), "--out", str(tmp_path / "x.safetensors")])  # fmt: skip
