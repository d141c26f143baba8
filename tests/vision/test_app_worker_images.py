"""The app's worker against the real engine and a tiny vision-language model: a conversation
whose messages carry image bytes (as the chat controller sends them) becomes content parts, is
encoded with the images and streamed; a quantized KV cache is what the load asked for."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from app.worker import EngineWorker
from engine.api import GenerationRequest


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("arch", ["Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_worker_streams_a_chat_with_images(arch, tiny_vlm_factory) -> None:
    directory, _, _ = tiny_vlm_factory(arch)
    worker = EngineWorker()
    loaded, finished, errors, chunks = [], [], [], []
    worker.loaded.connect(loaded.append)
    worker.error.connect(errors.append)
    worker.chunk.connect(lambda _rid, text: chunks.append(text))
    worker.generationFinished.connect(lambda _rid, stats: finished.append(stats))
    worker.load(str(directory), "cpu", (4, 8))  # called directly: this test is the worker's thread
    assert not errors and loaded[0].sees_images is True and loaded[0].cache_bits == (4, 8)
    assert worker._session.generator.cache.bits == (4, 8)  # the cache the load asked for

    first, second = png(30, 45, 1), png(61, 22, 2)
    messages = [
        {"role": "user", "content": "What is this?", "images": [first]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "And these two?", "images": [first, second]},
    ]
    worker.generate(1, messages, GenerationRequest({"temperature": 0.0}, max_new_tokens=4))
    assert not errors, errors
    stats = finished[-1]
    assert stats.stop_reason in ("eos", "max_new_tokens", "stop_string")
    assert stats.new_tokens > 0 and stats.prompt_tokens > 40  # images expanded to many tokens
    # The repeated picture was encoded once.
    assert worker._session.model.vision.encode_calls == 2

    # A broken image is a readable error, not a crash.
    broken = [{"role": "user", "content": "and?", "images": [b"not an image"]}]
    worker.generate(2, broken, GenerationRequest(max_new_tokens=4))
    assert finished[-1].stop_reason == "error" and "not an image" in finished[-1].error
