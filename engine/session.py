"""A loaded model ready to chat: the one facade the app's worker and the CLI use.

``ChatSession`` owns the model, its tokenizer and a :class:`Generator` (so the paged cache, and
with it the prefix cache, lives as long as the session: each chat turn re-uses the pages of the
turns before it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.generation.constraints import Constraint
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.model import LoadedModel, load_model
from engine.tokenizer import Tokenizer
from engine.vision.images import ImageInputError, ImageSource
from engine.vision.media import PromptMedia
from engine.vision.prompt import encode_chat_with_images

Progress = Callable[[float, str], None]


@dataclass
class StreamChunk:
    text: str
    token_ids: list[int]
    done: bool = False
    stop_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    tokens_per_second: float = 0.0
    error: str | None = None  # a constrained output that is invalid or incomplete says why


class ChatSession:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Tokenizer,
        cache_tokens: int | None = None,
        cache_bits: tuple[int, int] = (16, 16),
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.generator = Generator(model, tokenizer, cache_tokens=cache_tokens, cache_bits=cache_bits)
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
    ) -> ChatSession:
        tokenizer = Tokenizer.from_dir(model_dir)  # fail fast, before reading weights
        model = load_model(model_dir, device=device, dtype=dtype, progress=progress, context=cache_tokens)
        return cls(model, tokenizer, cache_tokens, cache_bits)

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

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.tokenizer.encode_chat(messages, add_generation_prompt=True))

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
