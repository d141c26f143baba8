"""The OpenAI-compatible server over one loaded model: what the HTTP handlers share.

:class:`OpenAIServer` takes a loaded :class:`~engine.session.ChatSession` (so whoever already
holds one, the CLI now and the app later, serves from that model and its cache) and drives its
Generator through an :class:`~engine.serve.engine_loop.EngineLoop`: requests of every client
share one batch. Its ``app`` is the ASGI application (:mod:`engine.serve.app`); running it under
uvicorn is :mod:`engine.serve.runner`'s business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ContextOverflowError
from engine.generation.constraints import json_schema
from engine.generation.job import Job
from engine.serve.engine_loop import EngineLoop
from engine.serve.errors import APIError
from engine.serve.media import resolve_dirs
from engine.serve.sampling import Sampling
from engine.tool_calls import PARSERS, detect_format

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class ServeOptions:
    model_name: str | None = None  # the id clients send as "model" (None: the folder's name)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set
    allowed_media_dirs: Sequence[str | Path] = ()  # folders whose images requests may name
    tool_format: str = "auto"  # tool-call format (engine.tool_calls.PARSERS) or auto
    # A request without max_tokens may write this many; each job reserves cache pages for its
    # whole budget up front, so the budget, not the context, decides how many run at once.
    default_max_tokens: int = 1024
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class OpenAIServer:
    def __init__(self, session: Any, options: ServeOptions | None = None) -> None:
        """``session``: a loaded ChatSession (model, tokenizer, generator)."""
        self.session = session
        self.options = options or ServeOptions()
        self.tokenizer = session.tokenizer
        self.model_name = self.options.model_name or session.model_name
        self.allowed_dirs = resolve_dirs(self.options.allowed_media_dirs)
        fmt = self.options.tool_format
        if fmt != "auto" and fmt not in PARSERS:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: auto, {', '.join(PARSERS)})")
        self.tool_format = detect_format(self.tokenizer) if fmt == "auto" else fmt
        self.engine = EngineLoop(session.generator)
        from engine.serve.app import build_app  # the HTTP layer imports this module's types

        self.app = build_app(self)

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        self.engine.close()

    # -- what requests may name ---------------------------------------------------------------

    @property
    def model_ids(self) -> list[str]:
        return [self.model_name]

    def check_model(self, name: str) -> None:
        if name not in self.model_ids:
            raise APIError(
                404,
                f"the model {name!r} does not exist on this server (it serves {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    # -- building jobs (run on the engine's thread, see EngineLoop) ---------------------------

    def chat_job(
        self,
        messages: list[dict[str, Any]],
        template_args: dict[str, Any],
        images: list[bytes],
        sampling: Sampling,
        schema: dict[str, Any] | None,
        stop_markers: Sequence[str] = (),
    ) -> Callable[[], Job]:
        def prepare() -> Job:
            tok = self.tokenizer
            if images:
                from engine.vision.prompt import encode_with_images

                text = tok.apply_chat_template(messages, add_generation_prompt=True, **template_args)
                ids, media = encode_with_images(tok, self.session.model.vision, text, images)
            else:
                ids, media = tok.encode_chat(messages, add_generation_prompt=True, **template_args), None
            return self._job(ids, sampling, schema, media, stop_markers)

        return prepare

    def completion_job(self, prompt: str | list[int], sampling: Sampling) -> Callable[[], Job]:
        def prepare() -> Job:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise APIError(400, "the prompt is empty (it encodes to no tokens)", param="prompt")
            return self._job(ids, sampling, None, None, ())

        return prepare

    def _job(
        self,
        ids: list[int],
        sampling: Sampling,
        schema: dict[str, Any] | None,
        media: Any,
        stop_markers: Sequence[str],
    ) -> Job:
        context = self.session.generator.context_length
        room = context - len(ids)
        if room < 1:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens; this server's context holds {context} "
                "(with room for at least one new token)"
            )
        budget = min(sampling.max_tokens or self.options.default_max_tokens, room)
        stop_ids = None
        extra = [self.tokenizer.token_to_id(m) for m in stop_markers]
        if any(t is not None for t in extra):
            model_eos = set(self.session.model.config.eos_token_ids)
            stop_ids = model_eos | self.tokenizer.eos_token_ids | {t for t in extra if t is not None}
        return Job(
            ids,
            budget,
            sampling.settings,
            sampling.stops,
            stop_token_ids=stop_ids,
            media=media,
            constraint=json_schema(schema) if schema is not None else None,
        )
