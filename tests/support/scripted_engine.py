"""A stand-in for a loaded ChatSession whose Generator replays scripted replies.

The server reads a session's tokenizer, generator, model name and a few flags; this one has a
real tokenizer and a generator that, for each job, yields the pieces its script returns, one per
``iterate()`` (the token ids are the piece's own encoding). Tests use it where the model's words
must be known in advance: a tool call the starter model would not write by itself, an API key
check that needs no model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from engine.errors import UsageError
from engine.generation.job import Job, JobResult

Script = Callable[[Job], list[str]]


@dataclass(eq=False)
class _Run:
    job: Job
    pieces: list[str]
    sent: int = 0
    tokens: int = 0


@dataclass
class ScriptedGenerator:
    tokenizer: object
    script: Script
    context_length: int = 2048
    seen: list[Job] = field(default_factory=list)
    _runs: dict[Job, _Run] = field(default_factory=dict)

    def enqueue(self, job: Job) -> None:
        if job.max_new_tokens < 1:
            raise UsageError("max_new_tokens must be a whole number >= 1")
        self.seen.append(job)
        self._runs[job] = _Run(job, list(self.script(job)))

    def cancel(self, job: Job) -> None:
        self._runs.pop(job, None)

    @property
    def num_remaining_jobs(self) -> int:
        return len(self._runs)

    def iterate(self) -> list[JobResult]:
        out = []
        for run in list(self._runs.values()):
            piece = run.pieces[run.sent]
            run.sent += 1
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            run.tokens += len(ids)
            done = run.sent == len(run.pieces)
            if done:
                del self._runs[run.job]
            out.append(
                JobResult(
                    run.job,
                    piece,
                    ids,
                    done,
                    "eos" if done else None,
                    prompt_tokens=len(run.job.input_ids),
                    new_tokens=run.tokens,
                )
            )
        return out


def scripted_session(tokenizer, script: Script) -> SimpleNamespace:
    """What OpenAIServer reads of a session, with a scripted generator."""
    return SimpleNamespace(
        tokenizer=tokenizer,
        generator=ScriptedGenerator(tokenizer, script),
        model_name="scripted",
        sees_images=False,
        model=SimpleNamespace(
            config=SimpleNamespace(eos_token_ids=list(tokenizer.eos_token_ids)), vision=None
        ),
    )
