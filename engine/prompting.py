"""Prompt policy: turning a front end's conversation into a prompt one model can take.

Two decisions live here, apart from any model: what happens to images a model cannot see
(:func:`apply_image_policy`), and which turns are left out when the conversation outgrows the
context (:func:`fit_to_context`). :func:`build_prompt` applies both and encodes the result through
a session's ``encode`` callable, so the real session and a test's stand-in share the policy. No
torch here: the functions work on message dicts and token counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.api import ChatMessage, GenerationRequest, ImagePolicy
from engine.errors import EngineError

# (engine-form messages, their images in prompt order) -> (token ids, the media the model needs;
# None for a text-only prompt)
Encode = Callable[[list[dict[str, Any]], list[bytes]], tuple[list[int], Any]]


class ImagesRefusedError(EngineError):
    """A model that cannot see images was asked about some."""


class Fit(NamedTuple):
    messages: list[ChatMessage]
    max_new_tokens: int
    dropped: int  # messages left out


def fit_to_context(
    messages: Sequence[ChatMessage],
    max_new_tokens: int,
    context_length: int,
    count: Callable[[list[ChatMessage]], int],
) -> Fit:
    """Make a conversation fit ``context_length`` tokens: leave out the oldest turns (never a
    system prompt or the newest message) until prompt + reply fit, then cap the reply at what is
    left. ``count`` gives a prompt's length in tokens.

    If even the system prompt and the last message do not fit, they are passed on unchanged and
    the engine's ContextOverflowError explains it. A context length <= 0 means unknown: nothing
    is counted or left out.
    """
    kept = list(messages)
    if context_length <= 0:
        return Fit(kept, max_new_tokens, 0)
    dropped = 0
    # Reserve room for a reply, but never more than half the context (a huge max_new_tokens
    # should shorten the reply, not erase the conversation).
    reserve = min(max_new_tokens, context_length // 2)
    prompt = count(kept)
    while prompt + reserve > context_length:
        oldest = next((i for i, m in enumerate(kept[:-1]) if m["role"] != "system"), None)
        if oldest is None:
            break
        del kept[oldest]
        dropped += 1
        prompt = count(kept)
    if prompt < context_length:
        max_new_tokens = min(max_new_tokens, context_length - prompt)
    return Fit(kept, max_new_tokens, dropped)


def has_images(messages: Sequence[ChatMessage]) -> bool:
    return any(m.get("images") for m in messages)


def without_images(messages: Sequence[ChatMessage]) -> tuple[list[ChatMessage], int]:
    """Plain text messages, and how many images were left out."""
    left_out = sum(len(m.get("images") or ()) for m in messages)
    return [{"role": m["role"], "content": m["content"]} for m in messages], left_out


def with_image_parts(messages: Sequence[ChatMessage]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The engine's form of a chat with images: a message with images gets content parts (one
    ``{"type": "image"}`` per image, then the text: the order the vision prompt builder and the
    chat templates expect), and the images come back as one list in prompt order."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for message in messages:
        attached = list(message.get("images") or ())
        # Tool use's keys go along (an assistant's calls, the call a tool message answers).
        extra = {k: message[k] for k in ("tool_calls", "tool_call_id") if k in message}
        if attached:
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in attached]
            parts.append({"type": "text", "text": message["content"]})
            out.append({"role": message["role"], "content": parts, **extra})
            images.extend(attached)
        else:
            out.append({"role": message["role"], "content": message["content"], **extra})
    return out, images


def apply_image_policy(
    messages: Sequence[ChatMessage], sees_images: bool, policy: ImagePolicy, model_name: str
) -> tuple[list[ChatMessage], int]:
    """The messages a model is shown, and how many images were left out of them. A model that
    sees images gets them all; for one that does not, ``policy`` decides (ImagesRefusedError when
    it refuses)."""
    if sees_images or not has_images(messages):
        return list(messages), 0
    policy = ImagePolicy(policy)
    refused = policy is ImagePolicy.REFUSE or (
        policy is ImagePolicy.REFUSE_NEW and bool(messages[-1].get("images"))
    )
    if refused:
        raise ImagesRefusedError(
            f"{model_name} cannot see images; load a vision model or send the message without its images"
        )
    return without_images(messages)


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, Any]]  # what was encoded, in the engine's form (content parts with images)
    ids: list[int]
    media: Any  # what the encoder returned beside the ids (engine.vision.media.PromptMedia or None)
    max_new_tokens: int  # the request's, capped by what the context has left
    trimmed_messages: int
    images_left_out: int


def build_prompt(
    messages: Sequence[ChatMessage],
    request: GenerationRequest,
    *,
    context_length: int,
    sees_images: bool,
    model_name: str,
    encode: Encode,
) -> Prompt:
    """Apply the image policy, fit to the context and encode: the prompt ``stream`` sends."""
    shown, left_out = apply_image_policy(messages, sees_images, request.images, model_name)
    # Counting means encoding (an image's token count depends on its size, a template may add
    # anything), so the last encoding is kept: the one that fits is the one sent.
    last: dict[tuple[int, ...], tuple[list[int], Any]] = {}

    def encoded(msgs: list[ChatMessage]) -> tuple[list[int], Any]:
        key = tuple(map(id, msgs))
        if key not in last:
            last.clear()
            last[key] = encode(*with_image_parts(msgs))
        return last[key]

    fit = fit_to_context(shown, request.max_new_tokens, context_length, lambda m: len(encoded(m)[0]))
    ids, media = encoded(fit.messages)
    engine_form, _ = with_image_parts(fit.messages)
    return Prompt(engine_form, list(ids), media, fit.max_new_tokens, fit.dropped, left_out)


def count_prompt_tokens(messages: Sequence[ChatMessage], *, sees_images: bool, encode: Encode) -> int:
    """A conversation's length in tokens as the model would be shown it (images a model cannot
    see left out), before any fitting."""
    shown, _ = apply_image_policy(messages, sees_images, ImagePolicy.LEAVE_OUT, "")
    return len(encode(*with_image_parts(shown))[0])
