"""Our preprocessing against each family's transformers Pillow image processor (issue 8,
acceptance 2), and clear errors for images that cannot be used (acceptance 4)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_vlms import VL_ARCHITECTURES

from engine.model import load_model
from engine.vision.images import ImageInputError, load_image

# (height, width): square, landscape, portrait, very small, very wide, very tall, large.
SIZES = [(30, 30), (30, 45), (61, 22), (3, 5), (12, 400), (500, 9), (300, 260)]


def picture(height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    return image.convert(mode)


@pytest.mark.parametrize("arch", VL_ARCHITECTURES)
def test_pixels_match_transformers(arch, tiny_vlm_factory):
    directory, _, processor = tiny_vlm_factory(arch)
    vision = load_model(directory, device="cpu").vision
    for height, width in SIZES:
        for mode in ("RGB", "RGBA", "L"):
            image = picture(height, width, mode)
            ours = vision.prepare(image).pixels
            ref = processor.image_processor(images=[image], return_tensors="pt")
            expected = ref["pixel_values"]
            if arch.startswith("Gemma3"):
                expected = expected[0]
            elif arch.startswith("Mistral3"):
                h, w = ref["image_sizes"][0].tolist()
                expected = expected[0, :, :h, :w]
            assert ours.shape == expected.shape, (height, width, mode)
            assert torch.allclose(ours, expected, atol=1e-5, rtol=0), (height, width, mode)


def test_bad_images_give_clear_errors(tmp_path):
    with pytest.raises(ImageInputError, match="cannot read"):
        load_image(tmp_path / "missing.png")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageInputError, match="empty"):
        load_image(empty)
    with pytest.raises(ImageInputError, match="not an image"):
        load_image(b"this is plain text, not a picture")
    buffer = io.BytesIO()
    picture(40, 40).save(buffer, format="PNG")
    with pytest.raises(ImageInputError, match="corrupt|cannot be decoded"):
        load_image(buffer.getvalue()[:200])  # truncated pixel data
    with pytest.raises(ImageInputError, match="no pixels"):
        load_image(Image.new("RGB", (0, 0)))
    with pytest.raises(ImageInputError, match="too large"):
        load_image(Image.new("1", (20000, 20000)))
