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
from engine.completion_text import completion_text
from engine.generation.constraints import Constraint, json_schema
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.model import LoadedModel, load_model
from engine.options import DEFAULT_OPTIONS, EngineOptions
from engine.prompting import build_prompt, count_prompt_tokens
from engine.reasoning import ReplyParts, reply_splitter
from engine.tokenizer import Tokenizer
from engine.tool_calls.chat_stream import ToolChat, has_tool_history
from engine.vision.images import ImageInputError, ImageSource
from engine.vision.media import PromptMedia
from engine.vision.prompt import encode_chat_with_images

Progress = Callable[[float, str], None]
# New tokens of each warm-up reply: the prefill's token, then two decode steps (on a GPU the first
# captures the step's CUDA graph, the second replays it). Few, as on a CPU every step is compute.
WARM_UP_TOKENS = 3

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
        self.warmed_up = False

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

    def count_tokens(self, messages: Sequence[ChatMessage], completion: bool = False) -> int:
        """The prompt's length in tokens; images count what they expand to (encoding them: the
        vision tower's cache keeps a picture from being encoded twice). ``completion``: as the
        plain text of completion mode (``GenerationRequest.completion``)."""
        encode = self._encode_plain if completion else self._encode
        return count_prompt_tokens(messages, sees_images=self.sees_images, encode=encode)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.has_chat_template

    def warm_up(self) -> None:
        """Run short replies (on a GPU greedy and sampled: their decode steps take different
        paths) and drop them, so the one-time costs of a first reply (the first forward steps,
        kernels loaded and tuned, CUDA graphs captured, the chat template compiled) are paid now,
        while the model loads, rather than after the user's first Send. Once per session."""
        if self.warmed_up:
            return
        if self.has_chat_template:
            try:  # compiles the template (the model needs no long prompt to warm up)
                self.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
            except Exception:  # a template that wants more than one turn: the first reply will say
                pass
        ids = self.tokenizer.encode("Hello") or [0]
        # The app's default sampling, seeded; the second job runs after the first (batch 1, as a
        # chat's replies do) and neither stops early at an end-of-text token.
        # On a CPU there are no kernels to load or graphs to capture, and every step is compute:
        # one short greedy reply pays the first steps' costs there.
        runs = [SamplingSettings.greedy()]
        if self.model.device.type != "cpu":
            runs.append(SamplingSettings(temperature=0.7, top_p=0.95, seed=0))
        for settings in runs:
            self.generator.generate([Job(ids, WARM_UP_TOKENS, settings, stop_token_ids=())])
        self.warmed_up = True

    def stream(
        self,
        messages: Sequence[ChatMessage],
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> ChunkStream:
        """Reply to a conversation in the app's form (see ``engine.api``): images per the
        request's policy, the chat template (or, with ``request.completion``, the plain text of
        completion mode), and the oldest turns left out when it outgrows the context; every chunk
        says how many messages and images were left out. ``on_prefill``: see ``stream_ids``."""
        # Both before any model work, so a bad value or schema fails at once.
        settings = sampling_settings(request.sampling)
        constraint = json_schema(request.json_schema) if request.json_schema.strip() else None
        # Tools offered, or calls in the history: the template gets them in the model's own
        # format, and the reply's calls are read back into the chunks' tool_calls.
        tools = None
        if not request.completion and (request.tools or has_tool_history(messages)):
            tools = ToolChat(self.tokenizer, request.tools)
        encode = self._encode_plain if request.completion else self._encode
        if tools is not None:
            encode = self._tool_encoder(tools)
        prompt = build_prompt(
            messages,
            request,
            context_length=self.context_length,
            sees_images=self.sees_images,
            model_name=self.model_name,
            encode=encode,
        )
        chunks = self.stream_ids(
            prompt.ids,
            settings,
            prompt.max_new_tokens,
            request.stop_strings,
            should_stop,
            media=prompt.media,
            constraint=constraint,
            split_reasoning=not request.completion and (tools is None or tools.format != "harmony"),
            on_prefill=on_prefill,
        )
        with closing(chunks):  # a caller that stops early frees the job's pages at once
            for chunk in chunks:
                if tools is not None:
                    chunk = tools.read(chunk)
                yield replace(
                    chunk, trimmed_messages=prompt.trimmed_messages, images_left_out=prompt.images_left_out
                )

    def _tool_encoder(self, tools: ToolChat) -> Callable[[list[dict], list[bytes]], tuple[list[int], Any]]:
        def encode(messages: list[dict], images: list[bytes]) -> tuple[list[int], PromptMedia | None]:
            shaped = tools.messages(messages)
            if images:
                return self.encode_chat_with_images(shaped, images)
            return self.tokenizer.encode_chat(shaped, add_generation_prompt=True, **tools.template_args), None

        return encode

    def _encode(self, messages: list[dict], images: list[bytes]) -> tuple[list[int], PromptMedia | None]:
        if images:
            return self.encode_chat_with_images(messages, images)
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True), None

    def _encode_plain(self, messages: list[dict], images: list[bytes]) -> tuple[list[int], None]:
        """Completion mode: the conversation as plain text (``engine.completion_text``)."""
        if images:
            raise ImageInputError("plain-text completion cannot show images")
        return self.tokenizer.encode(completion_text(messages)), None

    def stream_ids(
        self,
        input_ids: Sequence[int],
        settings: SamplingSettings,
        max_new_tokens: int = 512,
        stop_strings: Sequence[str] = (),
        should_stop: Callable[[], bool] | None = None,
        media: PromptMedia | None = None,
        constraint: Constraint | None = None,
        split_reasoning: bool = False,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> Iterator[StreamChunk]:
        """Stream the continuation of ``input_ids``; ``should_stop`` is polled every step.
        ``media``: the prompt's images (see :meth:`encode_chat_with_images`). ``constraint``
        (see ``engine.generation.constraints``) shapes the output, e.g. as JSON. With
        ``split_reasoning`` (a chat reply, the prompt ending where the assistant's turn starts), a
        reply with a reasoning part (``engine.reasoning``) streams it in the chunks' ``reasoning``,
        apart from the answer in their ``text``. ``on_prefill(done, total)`` is called before every step
        while the prompt is still being read (its uncached tokens: read so far, to read)."""
        split = reply_splitter(self.tokenizer) if split_reasoning else None
        job = Job(list(input_ids), max_new_tokens, settings, stop_strings, media=media, constraint=constraint)
        started = time.perf_counter()
        self.generator.enqueue(job)
        try:
            while True:
                if should_stop is not None and should_stop():
                    self.generator.cancel(job)
                    yield StreamChunk("", [], True, "cancelled", len(input_ids))
                    return
                if on_prefill is not None:
                    reading = self.generator.prefill_progress(job)
                    if reading is not None:
                        on_prefill(*reading)
                for r in self.generator.iterate():
                    if r.job is not job:
                        continue
                    parts = ReplyParts(answer=r.text)
                    if split is not None:
                        parts = split.feed(r.text, r.token_ids) + (split.finish() if r.done else ReplyParts())
                    yield StreamChunk(
                        parts.answer,
                        r.token_ids,
                        r.done,
                        r.stop_reason,
                        r.prompt_tokens,
                        r.cached_tokens,
                        r.new_tokens,
                        r.timings.tokens_per_second(r.new_tokens)
                        or r.new_tokens / max(time.perf_counter() - started, 1e-9),
                        r.error,
                        reasoning=parts.reasoning,
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
            ids,
            settings,
            max_new_tokens,
            stop_strings,
            should_stop,
            constraint=constraint,
            split_reasoning=True,
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
