"""A loaded session serving HTTP clients and its own front end at once.

While an :class:`~engine.serve.engine_loop.EngineLoop` drives a session's Generator for the
server, the session's own ``stream`` (the app's chats) must not drive the Generator beside it.
:class:`LoopedGenerator` stands in for the Generator in the session for that time: it offers the
calls ``ChatSession.stream_ids`` makes (``enqueue``, ``iterate``, ``cancel``,
``prefill_progress``) and routes each job through the loop, so the app's replies join the same
continuous batch as the HTTP requests. Everything else (context length, cache) is the real
Generator's. :func:`share_session` swaps it in and hands back a function that swaps it out.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from engine.generation.job import Job, JobResult
from engine.serve.engine_loop import Accepted, EngineLoop, Ticket

WAIT_S = 0.05  # iterate() waits this long for a result, so the caller can poll its stop flag


class LoopedGenerator:
    def __init__(self, loop: EngineLoop, generator: Any) -> None:
        self._loop, self._generator = loop, generator
        self._results: queue.Queue[JobResult | Accepted | BaseException] = queue.Queue()
        self._tickets: dict[Job, Ticket] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def enqueue(self, job: Job) -> None:
        self._tickets[job] = self._loop.submit(lambda: job, self._results.put)

    def iterate(self) -> list[JobResult]:
        try:
            items = [self._results.get(timeout=WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._results.get_nowait())
            except queue.Empty:
                break
        out = []
        for item in items:
            if isinstance(item, Accepted):
                continue
            if isinstance(item, BaseException):
                raise item
            if item.done:
                self._tickets.pop(item.job, None)
            out.append(item)
        return out

    def cancel(self, job: Job) -> None:
        ticket = self._tickets.pop(job, None)
        if ticket is not None:
            self._loop.cancel(ticket)

    def prefill_progress(self, job: Job) -> tuple[int, int] | None:
        return None  # the loop's thread owns the Generator's state; not read from here


def share_session(session: Any, loop: EngineLoop) -> Callable[[], None]:
    """Route ``session``'s own replies through ``loop``; returns the function that undoes it."""
    generator = session.generator
    session.generator = LoopedGenerator(loop, generator)

    def restore() -> None:
        session.generator = generator

    return restore
