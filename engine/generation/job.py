"""A generation job (what to generate) and the results a generator streams for it."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.generation.sampling import SamplingSettings

if TYPE_CHECKING:
    from engine.generation.constraints import Constraint

_ids = itertools.count()


@dataclass(eq=False)
class Job:
    """One sequence to continue. Identity is the object itself (two equal prompts are two jobs)."""

    input_ids: Sequence[int]
    max_new_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings.greedy)
    stop_strings: Sequence[str] = ()
    stop_token_ids: Iterable[int] | None = None  # None: the model's EOS ids
    # engine.vision.media.PromptMedia: the prompt's images, spliced in at their placeholders
    media: Any = None
    identifier: Any = None
    serial: int = field(default_factory=lambda: next(_ids))
    # Output must follow this (JSON schema, regex, grammar: engine.generation.constraints).
    constraint: Constraint | None = None


@dataclass
class Timings:
    queued_s: float = 0.0  # enqueue -> first forward step
    prefill_s: float = 0.0  # first forward step -> first token
    decode_s: float = 0.0  # first token -> last token

    def tokens_per_second(self, new_tokens: int) -> float:
        """Decode speed: tokens after the first over the time they took."""
        return (new_tokens - 1) / self.decode_s if new_tokens > 1 and self.decode_s > 0 else 0.0


@dataclass
class JobResult:
    """What one iteration produced for one job: a delta, not the whole text so far."""

    job: Job
    text: str
    token_ids: list[int]
    done: bool = False
    # "eos" | "stop_string" | "max_new_tokens" (the job's budget is spent) | "context_length"
    # (prompt + reply fill the model's context or the cache: no budget could have gone further)
    # | "cancelled"; with a constraint also "constraint_complete" (the output is finished) and
    # "constraint_error" (it cannot be)
    stop_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from cached pages, not prefilled
    new_tokens: int = 0
    timings: Timings = field(default_factory=Timings)
    error: str | None = None  # why a constrained output is invalid or incomplete; None when fine
