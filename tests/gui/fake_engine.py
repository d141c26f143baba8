"""A scripted stand-in for ``engine.session.ChatSession``, for fast GUI tests.

``FakeSession`` satisfies ``engine.api.SessionProtocol`` as the real session does (a test checks
it), streams canned text with a delay per token, and can be told to fail while loading or
mid-reply. It builds its prompts with the engine's own prompt policy (``engine.prompting``), so
fitting to the context and the image rules are the real ones; only encoding is faked: a message
costs its words + 4 tokens and an image ``IMAGE_TOKENS``. With ``sees_images`` it is a vision model
and reads each image with the engine's own Pillow loader, so bad images fail as they would for
real. Nothing here imports torch. Without a chat template (``chat_template=False``: a base model)
it encodes completion-mode prompts with the engine's ``completion_text``; a long prompt is "read"
in chunks of ``prefill_chunk`` tokens (``prefill_delay`` each), reported through ``on_prefill``.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.api import ChatMessage, ChunkStream, GenerationRequest, StreamChunk
from engine.completion_text import completion_text
from engine.errors import EngineError
from engine.prompting import Prompt, build_prompt, count_prompt_tokens


class FakeConstraintError(EngineError):
    """Stands in for engine.generation.constraints.ConstraintError (an EngineError too)."""


@dataclass(frozen=True)
class FakeConstraint:
    """Stands in for engine.generation.constraints' JSON-schema Constraint: the schema it was
    built from (the fake does not enforce it: ``FakeEngine.reply`` decides the text)."""

    schema_text: str


def tokens_of(text: str) -> list[str]:
    """Split into word-ish pieces that concatenate back to ``text`` exactly."""
    return re.findall(r"\s*\S+|\s+", text)


def text_of(content: str | list[dict]) -> str:
    """A message's text, whether plain or content parts."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def images_in(content: str | list[dict]) -> int:
    return 0 if isinstance(content, str) else sum(1 for part in content if part.get("type") == "image")


def default_reply(messages: list[dict]) -> str:
    last = text_of(messages[-1]["content"]) if messages else ""
    return f"You said: {last}. Here is some code:\n\n```python\nprint({last!r})\n```\n\nDone."


# Tokens one image stands for in the fake's prompts (real models: 64 to thousands, by size).
IMAGE_TOKENS = 16


@dataclass
class FakeMedia:
    """Stands in for engine.vision.media.PromptMedia: what the fake encoded."""

    messages: list[dict]
    image_sizes: list[tuple[int, int]]


@dataclass
class FakeEngine:
    """Configuration + call log shared by every session it makes; pass ``engine.factory``."""

    reply: Callable[[list[dict]], str] = default_reply
    token_delay: float = 0.002
    load_delay: float = 0.0
    load_error: BaseException | None = None
    # Raise this after ``fail_after_tokens`` tokens of a reply.
    generate_error: BaseException | None = None
    fail_after_tokens: int = 0
    context_length: int = 2048
    sees_images: bool = False
    chat_template: bool = True  # False: a base model (plain-text completion only)
    prefill_chunk: int = 512  # prompt tokens "read" per step
    prefill_delay: float = 0.0  # seconds per prefill step
    warm_up_delay: float = 0.0
    warm_ups: int = 0  # calls of FakeSession.warm_up that did the work
    # A constrained reply ends with "constraint_error" and this message instead of completing.
    constraint_error: str | None = None
    # The tool calls (OpenAI's form) a reply to these messages makes, when the request offers tools.
    tool_calls: Callable[[list[dict]], list[dict]] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    image_calls: list[dict[str, Any]] = field(default_factory=list)  # encode_chat_with_images
    loads: list[str] = field(default_factory=list)
    load_options: list[dict[str, Any]] = field(default_factory=list)
    unloads: int = 0
    # Set when a token has been produced; tests wait on it to stop "mid-reply".
    streaming: threading.Event = field(default_factory=threading.Event)

    def factory(
        self,
        model_dir: str,
        device: str,
        progress: Callable[[float, str], None],
        cache_bits: tuple[int, int] = (16, 16),
        context: int | None = None,
        parallel: Any = None,
    ) -> FakeSession:
        for i in range(5):
            progress(i / 5, f"Loading layer {i + 1}/5")
            time.sleep(self.load_delay / 5)
        if self.load_error is not None:
            raise self.load_error
        self.loads.append(model_dir)
        self.load_options.append({"device": device, "cache_bits": cache_bits, "context": context})
        if parallel is not None:  # the worker passes it only for a load across several GPUs
            self.load_options[-1]["parallel"] = parallel
        return FakeSession(self, Path(model_dir).name, context)

    def sampling(self, values: dict[str, Any]) -> dict[str, Any]:
        """Stands in for engine.generation.sampling.SamplingSettings construction."""
        return dict(values)

    def constraint(self, schema_text: str) -> FakeConstraint:
        """Stands in for engine.generation.constraints.json_schema (which would import torch):
        refuses what is not JSON, as the real one does, with an EngineError like ConstraintError."""
        try:
            json.loads(schema_text)
        except ValueError as exc:
            raise FakeConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        return FakeConstraint(schema_text)


class FakeSession:
    def __init__(self, engine: FakeEngine, name: str, context: int | None = None) -> None:
        self.engine = engine
        self.model_name = name
        # As the real engine: the context asked for, up to the model's own.
        self.context_length = min(engine.context_length, context) if context else engine.context_length
        self.device = "cpu"
        self.sees_images = engine.sees_images
        self.has_chat_template = engine.chat_template
        self.warmed_up = False

    def memory_bytes(self) -> int:
        return 123 * 1024 * 1024

    def warm_up(self) -> None:
        if self.warmed_up:
            return
        time.sleep(self.engine.warm_up_delay)
        self.engine.warm_ups += 1
        self.warmed_up = True

    def count_tokens(self, messages: Sequence[ChatMessage], completion: bool = False) -> int:
        encode = self._encode_plain if completion else self._encode
        return count_prompt_tokens(messages, sees_images=self.sees_images, encode=encode)

    def stream(
        self,
        messages: Sequence[ChatMessage],
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> ChunkStream:
        # As the real session: settings and constraint first, so bad ones fail before any work.
        settings = self.engine.sampling(dict(request.sampling))
        constraint = self.engine.constraint(request.json_schema) if request.json_schema.strip() else None
        prompt = build_prompt(
            messages,
            request,
            context_length=self.context_length,
            sees_images=self.sees_images,
            model_name=self.model_name,
            encode=self._encode_plain if request.completion else self._encode,
        )
        call = {
            "messages": prompt.messages,
            "settings": settings,
            "max_new_tokens": prompt.max_new_tokens,
            "media": prompt.media,
            "constraint": constraint,
            "prompt_tokens": len(prompt.ids),
            "request": request,
            "completion": request.completion,
            "warmed_up": self.warmed_up,
        }
        self.engine.calls.append(call)
        # "Reading" the prompt, a chunk per step, as the real generator prefills.
        total = len(prompt.ids)
        for done in range(0, total, max(1, self.engine.prefill_chunk)):
            if should_stop is not None and should_stop():
                break
            if on_prefill is not None:
                on_prefill(done, total)
            time.sleep(self.engine.prefill_delay)
        yield from self._stream(call, prompt, should_stop)

    def _encode_plain(self, messages: list[dict], images: list[bytes]) -> tuple[list[int], None]:
        """Completion mode, as the real session: the conversation as plain text."""
        return list(range(len(tokens_of(completion_text(messages))))), None

    def _encode(self, messages: list[dict], images: list[bytes]) -> tuple[list[int], FakeMedia | None]:
        """Stands in for the chat template + tokenizer (+ vision encoder when there are images)."""
        if not self.has_chat_template:
            # The real tokenizer's words (engine.tokenizer): a base model cannot be sent a chat.
            raise EngineError(
                f"{self.model_name}: the model has no chat template; use plain completion instead"
            )
        if not images:
            return list(range(_count(messages))), None
        from engine.vision.images import ImageInputError, load_image

        if not self.sees_images:
            raise ImageInputError(f"{self.model_name} cannot see images (it has no vision tower)")
        parts = sum(images_in(m["content"]) for m in messages)
        if parts != len(images):
            raise ImageInputError(f"the prompt has {parts} image placeholders but {len(images)} images")
        sizes = [load_image(image).size for image in images]
        self.engine.image_calls.append({"messages": list(messages), "images": list(images)})
        return list(range(_count(messages))), FakeMedia(list(messages), sizes)

    def _stream(
        self, call: dict[str, Any], prompt: Prompt, should_stop: Callable[[], bool] | None
    ) -> ChunkStream:
        engine = self.engine
        pieces = tokens_of(engine.reply(prompt.messages))
        started = time.perf_counter()
        produced = 0

        def chunk(text: str, stop_reason: str | None = None, error: str | None = None) -> StreamChunk:
            return StreamChunk(
                text,
                [],
                done=stop_reason is not None,
                stop_reason=stop_reason,
                prompt_tokens=len(prompt.ids),
                new_tokens=produced,
                tokens_per_second=_rate(produced, started),
                error=error,
                trimmed_messages=prompt.trimmed_messages,
                images_left_out=prompt.images_left_out,
            )

        for piece in pieces:
            if should_stop is not None and should_stop():
                yield chunk("", "cancelled")
                return
            if engine.generate_error is not None and produced >= engine.fail_after_tokens:
                raise engine.generate_error
            if produced >= prompt.max_new_tokens:
                yield chunk("", "max_new_tokens")
                return
            # Paced against the clock (not sleep-per-token), so 1/200 s really gives 200 tokens/s.
            delay = started + (produced + 1) * engine.token_delay - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            produced += 1
            engine.streaming.set()
            yield chunk(piece)
        if call["constraint"] is None:
            calls = engine.tool_calls(prompt.messages) if engine.tool_calls and call["request"].tools else []
            yield replace(chunk("", "eos"), tool_calls=tuple(calls))
        elif engine.constraint_error is not None:
            yield chunk("", "constraint_error", engine.constraint_error)
        else:
            # The real engine ends a JSON constraint at the document's last bracket.
            yield chunk("", "constraint_complete")

    def unload(self) -> None:
        self.engine.unloads += 1


def _count(messages: list[dict]) -> int:
    return sum(
        len(tokens_of(text_of(m["content"]))) + 4 + IMAGE_TOKENS * images_in(m["content"]) for m in messages
    )


def _rate(n: int, started: float) -> float:
    elapsed = time.perf_counter() - started
    return n / elapsed if elapsed > 0 else 0.0


def make_model_dir(target: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """A folder that ``engine.inspect`` accepts as a loadable model (the fake never reads it)."""
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 2048,
    }
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F16", "shape": [8, 8], "data_offsets": [0, 128]}}).encode()
    (target / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(128))
    return target


def fake_starter(models_dir: Path, progress: Callable[[float, str], None] | None = None) -> Path:
    """Stands in for engine.starter.ensure_starter_model: makes a model folder, reports progress."""
    for i in range(3):
        if progress:
            progress(i / 3, "Importing starter model")
    return make_model_dir(models_dir / "SmolLM2-135M-Instruct")
