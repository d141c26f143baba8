"""A loaded model ready to chat: the one facade the app's worker and the CLI use.

``ChatSession`` owns the model, its tokenizer and a :class:`Generator` (so the paged cache, and
with it the prefix cache, lives as long as the session: each chat turn re-uses the pages of the
turns before it). :meth:`ChatSession.stream` is the front ends' way in (see ``engine.api``): it takes
the app's messages and a :class:`GenerationRequest` and does the rest, images, chat template and
fitting to the context included; ``stream_ids`` and ``stream_chat`` are the lower steps the CLI
uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from engine.api import ChatMessage, ChunkStream, GenerationRequest, StreamChunk
from engine.generation.constraints import Constraint, json_schema
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.model import LoadedModel, load_model
from engine.options import DEFAULT_OPTIONS, EngineOptions
from engine.prompting import build_prompt, count_prompt_tokens
from engine.tokenizer import Tokenizer
from engine.vision.images import ImageInputError, ImageSource
from engine.vision.media import PromptMedia
from engine.vision.prompt import encode_chat_with_images

Progress = Callable[[float, str], None]

__all__ = ["ChatSession", "StreamChunk", "sampling_settings"]


def sampling_settings(values: Mapping[str, Any]) -> SamplingSettings:
    """SamplingSettings from plain values by field name (names it lacks are ignored), checked:
    a bad value is named before any model work."""
    known = {f.name for f in fields(SamplingSettings)}
    settings = SamplingSettings(**{k: v for k, v in values.items() if k in known})
    settings.validate()
    return settings


class ChatSession:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Tokenizer,
        cache_tokens: int | None = None,
        cache_bits: tuple[int, int] = (16, 16),
        options: EngineOptions | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.generator = Generator(
            model,
            tokenizer,
            cache_tokens=cache_tokens,
            cache_bits=cache_bits,
            options=options or DEFAULT_OPTIONS,
        )
        # A rendered prompt longer than a few characters per token of context could never be
        # used, so the chat template may not write (or build) more than that.
        tokenizer.template_limits = tokenizer.template_limits.for_context(model.spec.max_position_embeddings)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str = "auto",
        progress: Progress | None = None,
        cache_tokens: int | None = None,
        dtype: str | None = None,
        cache_bits: tuple[int, int] = (16, 16),
        options: EngineOptions | None = None,
    ) -> ChatSession:
        """``options``: the engine's; the process's kernels follow them too (None: the defaults
        for generation, the kernels as they are)."""
        tokenizer = Tokenizer.from_dir(model_dir)  # fail fast, before reading weights
        model = load_model(
            model_dir, device=device, dtype=dtype, progress=progress, context=cache_tokens, options=options
        )
        return cls(model, tokenizer, cache_tokens, cache_bits, options)

    @property
    def model_name(self) -> str:
        return self.model.directory.name

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def context_length(self) -> int:
        return self.generator.context_length

    def memory_bytes(self) -> int:
        return self.model.parameter_bytes() + self.generator.cache.nbytes

    def count_tokens(self, messages: Sequence[ChatMessage]) -> int:
        """The prompt's length in tokens; images count what they expand to (encoding them: the
        vision tower's cache keeps a picture from being encoded twice)."""
        return count_prompt_tokens(messages, sees_images=self.sees_images, encode=self._encode)

    def stream(
        self,
        messages: Sequence[ChatMessage],
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
    ) -> ChunkStream:
        """Reply to a conversation in the app's form (see ``engine.api``): images per the
        request's policy, the chat template, and the oldest turns left out when it outgrows the
        context; every chunk says how many messages and images were left out."""
        # Both before any model work, so a bad value or schema fails at once.
        settings = sampling_settings(request.sampling)
        constraint = json_schema(request.json_schema) if request.json_schema.strip() else None
        prompt = build_prompt(
            messages,
            request,
            context_length=self.context_length,
            sees_images=self.sees_images,
            model_name=self.model_name,
            encode=self._encode,
        )
        chunks = self.stream_ids(
            prompt.ids,
            settings,
            prompt.max_new_tokens,
            request.stop_strings,
            should_stop,
            media=prompt.media,
            constraint=constraint,
        )
        with closing(chunks):  # a caller that stops early frees the job's pages at once
            for chunk in chunks:
                yield replace(
                    chunk, trimmed_messages=prompt.trimmed_messages, images_left_out=prompt.images_left_out
                )

    def _encode(self, messages: list[dict], images: list[bytes]) -> tuple[list[int], PromptMedia | None]:
        if images:
            return self.encode_chat_with_images(messages, images)
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True), None

    def stream_ids(
        self,
        input_ids: Sequence[int],
        settings: SamplingSettings,
        max_new_tokens: int = 512,
        stop_strings: Sequence[str] = (),
        should_stop: Callable[[], bool] | None = None,
        media: PromptMedia | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[StreamChunk]:
        """Stream the continuation of ``input_ids``; ``should_stop`` is polled every step.
        ``media``: the prompt's images (see :meth:`encode_chat_with_images`). ``constraint``
        (see ``engine.generation.constraints``) shapes the output, e.g. as JSON."""
        job = Job(list(input_ids), max_new_tokens, settings, stop_strings, media=media, constraint=constraint)
        started = time.perf_counter()
        self.generator.enqueue(job)
        try:
            while True:
                if should_stop is not None and should_stop():
                    self.generator.cancel(job)
                    yield StreamChunk("", [], True, "cancelled", len(input_ids))
                    return
                for r in self.generator.iterate():
                    if r.job is not job:
                        continue
                    yield StreamChunk(
                        r.text,
                        r.token_ids,
                        r.done,
                        r.stop_reason,
                        r.prompt_tokens,
                        r.cached_tokens,
                        r.new_tokens,
                        r.timings.tokens_per_second(r.new_tokens)
                        or r.new_tokens / max(time.perf_counter() - started, 1e-9),
                        r.error,
                    )
                    if r.done:
                        return
        finally:
            self.generator.cancel(job)  # no-op when finished; frees pages if the caller broke off

    def stream_chat(
        self,
        messages: list[dict],
        settings: SamplingSettings,
        max_new_tokens: int = 512,
        stop_strings: Sequence[str] = (),
        should_stop: Callable[[], bool] | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[StreamChunk]:
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        yield from self.stream_ids(
            ids, settings, max_new_tokens, stop_strings, should_stop, constraint=constraint
        )

    @property
    def sees_images(self) -> bool:
        return self.model.vision is not None

    def encode_chat_with_images(
        self, messages: list[dict], images: Sequence[ImageSource]
    ) -> tuple[list[int], PromptMedia]:
        """Token ids and media of a chat whose messages hold ``{"type": "image"}`` parts, one per
        image of ``images`` in order. Raises ImageInputError for unreadable images, and when the
        model cannot see images at all."""
        if self.model.vision is None:
            raise ImageInputError(f"{self.model_name} cannot see images (it has no vision tower)")
        return encode_chat_with_images(self.tokenizer, self.model.vision, messages, images)

    def unload(self) -> None:
        """Drop the model and cache so their memory can be reclaimed."""
        self.generator = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
