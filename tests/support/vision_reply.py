"""The M-RoPE vision families' generator check: a greedy reply after an image, batched beside a
text-only job, chooses at every step what transformers' own logits choose."""

from __future__ import annotations

import torch
from parity import reference_logits

from engine.generation.generator import Generator
from engine.generation.job import Job


def assert_replies_follow_reference(model, tokenizer, reference, inputs, ids, media, text_only) -> None:
    """Prefill in chunks of 20 (cutting through the image), pages of 16, 12 tokens per job.
    ``inputs``: the transformers processor's output for the image prompt (``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``); ``ids``/``media``: our encoding of it."""
    gen = Generator(model, tokenizer, cache_tokens=512, page_size=16, max_chunk_tokens=20)
    with_image, plain = gen.generate(
        [
            Job(ids, max_new_tokens=12, stop_token_ids=[], media=media),
            Job(text_only, max_new_tokens=12, stop_token_ids=[]),
        ]
    )
    sequence = ids + with_image.token_ids[:-1]
    reply = len(sequence) - len(ids)  # reply tokens are text: type 0, positions after the image
    types = torch.cat([inputs["mm_token_type_ids"], inputs["mm_token_type_ids"].new_zeros(1, reply)], dim=1)
    with torch.no_grad():
        logits = reference(
            input_ids=torch.tensor([sequence]),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=types,
        ).logits[0]
    assert logits[len(ids) - 1 :].argmax(-1).tolist() == with_image.token_ids
    text_logits = reference_logits(reference, text_only + plain.token_ids[:-1])
    assert text_logits[len(text_only) - 1 :].argmax(-1).tolist() == plain.token_ids
