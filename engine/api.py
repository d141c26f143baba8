"""The boundary between a front end (the app, a server, a script) and a loaded chat model.

A front end builds a :class:`GenerationRequest` and calls ``stream(messages, request)`` on a
:class:`SessionProtocol` (``engine.session.ChatSession`` is the real one); it gets
:class:`StreamChunk` s back and, from the last, a :class:`ReplyStats`. :class:`ModelInfo` says what
was loaded. Everything here is plain data: no torch, so the GUI thread can import it, and frozen,
so a value can cross threads without a copy.

Messages are dicts in the app's form: ``{"role", "content"}`` plus, optionally, ``"images"``: the
encoded bytes of the message's attached images, in order. The session turns them into what its
model takes (``engine.prompting``). Tool use follows OpenAI's shapes: a request may offer
``tools``; an assistant message may carry the ``tool_calls`` it made (arguments as JSON text) and a
``{"role": "tool", "tool_call_id", "content"}`` message answers each; a reply's calls come back in
its chunks' ``tool_calls``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NotRequired, Protocol, TypedDict, runtime_checkable


class ChatMessage(TypedDict):
    role: str
    content: str | list[dict[str, Any]]  # text, or content parts in the chat templates' form
    images: NotRequired[Sequence[bytes]]
    tool_calls: NotRequired[Sequence[dict[str, Any]]]  # an assistant's calls, OpenAI's form
    tool_call_id: NotRequired[str]  # a "tool" message: the call it answers


class ImagePolicy(StrEnum):
    """What a model that cannot see images does with messages that carry some."""

    # Leave out earlier messages' images (counted in the stats), refuse when the newest message
    # has any: an answer about a picture the model never saw would look like an answer about it.
    REFUSE_NEW = "refuse_new"
    LEAVE_OUT = "leave_out"  # leave every image out, counted in the stats
    REFUSE = "refuse"  # refuse any conversation with images


@dataclass(frozen=True)
class GenerationRequest:
    """How to reply: what a front end chooses, apart from the conversation itself."""

    # Values of engine.generation.sampling.SamplingSettings' fields by name (names it lacks are
    # ignored): plain values, so building a request needs no torch.
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 512
    stop_strings: tuple[str, ...] = ()
    json_schema: str = ""  # JSON schema text the reply must be valid under ("" = free text)
    images: ImagePolicy = ImagePolicy.REFUSE_NEW
    # Plain-text completion (base models, which have no chat template): no template, no system
    # prompt; the conversation's text is continued as it stands (engine.completion_text).
    completion: bool = False
    # Functions the model may call, in OpenAI's form ({"type": "function", "function": {...}});
    # the session renders them with the model's own template and reads its calls back.
    tools: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # Read-only copies: the request is shared with the engine thread.
        object.__setattr__(self, "sampling", MappingProxyType(dict(self.sampling)))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "images", ImagePolicy(self.images))


@dataclass(frozen=True)
class StreamChunk:
    """One step of a reply: new text, and the counts so far."""

    text: str
    token_ids: list[int]
    done: bool = False
    stop_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    tokens_per_second: float = 0.0
    error: str | None = None  # a constrained output that is invalid or incomplete says why
    # What fitting the conversation to the model did (see engine.prompting.build_prompt).
    trimmed_messages: int = 0
    images_left_out: int = 0
    # New text of the reply's reasoning (gpt-oss's analysis channel, engine.reasoning), kept out
    # of ``text``, which is then the answer alone; "" for models whose replies have no such part.
    reasoning: str = ""
    # Tool calls completed in this chunk, each whole, in OpenAI's form
    # ({"id", "type": "function", "function": {"name", "arguments"}}; arguments as JSON text).
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ReplyStats:
    """How a reply ended. ``stop_reason``: the engine's (eos, max_new_tokens, stop_string,
    context_length, constraint_complete, constraint_error), or cancelled, or error."""

    stop_reason: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    tokens_per_second: float = 0.0
    seconds: float = 0.0
    error: str = ""  # a human message, when the reply failed or its constraint could not be met
    trimmed_messages: int = 0  # oldest messages left out to fit the context
    images_left_out: int = 0  # images a text-only model was not shown
    # The reply's tool calls (StreamChunk.tool_calls of all its chunks); kept out of to_dict: the
    # store keeps them with the message, not with its stats.
    tool_calls: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, stop_reason: str, last: StreamChunk | None, seconds: float, error: str = "") -> ReplyStats:
        """The stats of a reply whose last chunk was ``last`` (None: it never started)."""
        if last is None:
            return cls(stop_reason, seconds=seconds, error=error)
        return cls(
            stop_reason,
            prompt_tokens=last.prompt_tokens,
            new_tokens=last.new_tokens,
            tokens_per_second=float(last.tokens_per_second),
            seconds=seconds,
            error=error,
            trimmed_messages=last.trimmed_messages,
            images_left_out=last.images_left_out,
        )

    def to_dict(self) -> dict[str, Any]:
        """The saved form: the optional facts only when they happened, as stored replies have
        always had them."""
        values = asdict(self)
        del values["tool_calls"]
        for name in ("error", "trimmed_messages", "images_left_out"):
            if not values[name]:
                del values[name]
        return values


# What ``stream`` returns: a generator, so a caller that stops reading can ``close()`` it.
ChunkStream = Generator[StreamChunk, None, None]


@runtime_checkable
class SessionProtocol(Protocol):
    """A loaded chat model, as a front end uses it. Its methods run on one thread at a time."""

    @property
    def model_name(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def sees_images(self) -> bool: ...

    def memory_bytes(self) -> int: ...

    @property
    def has_chat_template(self) -> bool:
        """False for a base model: only plain-text completion (``GenerationRequest.completion``)."""
        ...

    def count_tokens(self, messages: Sequence[ChatMessage], completion: bool = False) -> int:
        """The prompt's length in tokens, images included (as ``stream`` would send it, unfitted;
        ``completion``: as plain text, see ``GenerationRequest.completion``)."""
        ...

    def warm_up(self) -> None:
        """Pay the first reply's one-time costs now (a front end calls it while loading, behind
        the load's progress, so the first reply does not start with seconds of silence)."""
        ...

    def stream(
        self,
        messages: Sequence[ChatMessage],
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> ChunkStream:
        """Reply to ``messages``: images, chat template and fitting to the context are the
        session's business. ``should_stop`` is polled every step; the last chunk has ``done``.
        ``on_prefill(done, total)``: before the first token, how much of the prompt's uncached
        part has been read (a long prompt takes a while: a front end can say so)."""
        ...

    def unload(self) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What a load produced, for display and for the chat's decisions."""

    name: str
    path: str  # the folder as the load was asked for it
    context_length: int
    memory_bytes: int
    device: str
    sees_images: bool
    cache_bits: tuple[int, int] = (16, 16)  # KV cache key and value widths (16: unquantized)
    chat_template: bool = True  # False: a base model, replies by plain-text completion

    @classmethod
    def of(cls, session: SessionProtocol, path: str, cache_bits: tuple[int, int]) -> ModelInfo:
        return cls(
            name=session.model_name,
            path=path,
            context_length=int(session.context_length),
            memory_bytes=int(session.memory_bytes()),
            device=str(session.device),
            sees_images=bool(session.sees_images),
            cache_bits=cache_bits,
            chat_template=bool(session.has_chat_template),
        )
