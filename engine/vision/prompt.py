"""A chat with images -> token ids plus the :class:`PromptMedia` a job carries.

The chat template writes one marker per image (``<start_of_image>``, ``<|image_pad|>``,
``[IMG]``...); each marker is replaced by the family's placeholder text for that image's size
(as the family's transformers processor does), the text is tokenized, and the image's features
are assigned, in order, to the placeholder tokens the language model will see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.errors import EngineError
from engine.vision.base import PreparedImage, VisionModel
from engine.vision.images import ImageInputError, ImageSource, load_image
from engine.vision.media import ImagePlacement, PromptMedia


class AudioInputError(EngineError):
    """A prompt holds audio: no model here is run with its audio tower (Gemma 4's small sizes
    have one), so the prompt is refused rather than sent without it."""


AUDIO_PARTS = ("audio", "input_audio")  # content part types of HF chat templates and OpenAI


def refuse_audio(vision: VisionModel, messages: Sequence[Mapping[str, Any]] = (), text: str = "") -> None:
    """Raise :class:`AudioInputError` (the family's words) where ``messages`` have an audio part
    or the rendered ``text`` holds the family's audio marker."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, Mapping) and part.get("type") in AUDIO_PARTS for part in content
        ):
            raise AudioInputError(vision.audio_refusal)
    if vision.audio_marker and vision.audio_marker in text:
        raise AudioInputError(f"{vision.audio_refusal} (the prompt holds '{vision.audio_marker}')")


def user_message(text: str, image_count: int) -> dict[str, Any]:
    """One user turn holding ``image_count`` images first, then the text."""
    return {"role": "user", "content": [{"type": "image"}] * image_count + [{"type": "text", "text": text}]}


def count_images(messages: Sequence[Mapping[str, Any]]) -> int:
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, Mapping) and part.get("type") == "image")
    return count


def encode_with_images(
    tokenizer, vision: VisionModel, text: str, images: Sequence[ImageSource]
) -> tuple[list[int], PromptMedia]:
    """Token ids of ``text`` (a rendered prompt with one marker per image) and its media."""
    refuse_audio(vision, text=text)
    prepared = [vision.prepare(load_image(image)) for image in images]
    parts = text.split(vision.marker)
    if len(parts) - 1 != len(prepared):
        raise ImageInputError(
            f"the prompt has {len(parts) - 1} image placeholders ('{vision.marker}') "
            f"but {len(prepared)} images"
        )
    expanded = parts[0] + "".join(
        vision.placeholder(image) + part for image, part in zip(prepared, parts[1:])
    )
    ids = tokenizer.encode(expanded, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids, place_images(vision, ids, prepared)


def place_images(vision: VisionModel, ids: list[int], prepared: list[PreparedImage]) -> PromptMedia:
    """Encode the images (or take them from the cache) and assign them to placeholder rows."""
    slots = (torch.tensor(ids) == vision.image_token_id).nonzero().flatten()
    features = [vision.encode(image) for image in prepared]
    needed = sum(int(f.embeddings.shape[0]) for f in features)
    if needed != slots.numel():
        raise ImageInputError(
            f"the prompt has {slots.numel()} image tokens but its {len(prepared)} images need {needed}"
        )
    placements, at = [], 0
    for image, feature in zip(prepared, features):
        n = int(feature.embeddings.shape[0])
        placements.append(ImagePlacement(slots[at : at + n], feature, image.key))
        at += n
    media = PromptMedia(len(ids), placements, bidirectional=vision.bidirectional)
    rope = vision.rope_positions(ids, placements, prepared)
    if rope is not None:
        media.rope_positions, media.rope_delta = rope
    return media


def encode_chat_with_images(
    tokenizer, vision: VisionModel, messages: Sequence[Mapping[str, Any]], images: Sequence[ImageSource]
) -> tuple[list[int], PromptMedia]:
    """Render ``messages`` (content parts ``{"type": "image"}`` where each image goes, in the
    order of ``images``) with the chat template and the generation prompt, then encode. A
    message with an audio part is refused (:func:`refuse_audio`)."""
    refuse_audio(vision, messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return encode_with_images(tokenizer, vision, text, images)
