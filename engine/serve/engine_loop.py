"""One thread that drives one :class:`~engine.generation.generator.Generator` for many callers.

The Generator is not thread-safe and batches only what it is given between two ``iterate()``
calls, so every request of every client goes through here: a caller :meth:`EngineLoop.submit` s
a *prepare* function (which renders and tokenizes the prompt, and encodes its images with the
model's vision tower: work that must not race the model, so it runs on this thread too) and a
*sink*. The loop builds the job, enqueues it beside the running ones, tells the sink
(:data:`ACCEPTED`), and hands each
:class:`~engine.generation.job.JobResult` of that job to the sink as it comes: one loaded model,
one paged cache, continuous batching across clients.

Sinks are called on the loop's thread and must only hand the value on (the server's put it into
an asyncio queue through ``call_soon_threadsafe``). A sink gets an exception instead of a result
when the job could not be built or enqueued (the request's fault, usually), or when a forward
step failed (then every running job gets it, and the loop goes on with new ones).

The loop takes an existing Generator, so anything that holds a loaded session (the app's worker,
later) can serve from the same model and cache. While the loop runs it is the Generator's only
caller: a front end that shares the model submits its own jobs through the loop as well
(``ChatSession.stream`` drives the Generator itself and must not run beside it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.generation.generator import Generator
from engine.generation.job import Job, JobResult

IDLE_STEP_S = 0.0005  # an iterate() quicker than this computed nothing


class Accepted:
    """What a sink gets once its job is enqueued: from here on the request is the engine's
    (a server can answer 200 and start streaming)."""

    def __repr__(self) -> str:
        return "ACCEPTED"


ACCEPTED = Accepted()
Sink = Callable[[JobResult | Accepted | BaseException], None]


class EngineClosedError(RuntimeError):
    """The loop was closed while a job was waiting or running."""


@dataclass(eq=False)
class Ticket:
    """A submitted request: its job once built, and whether the caller gave up on it."""

    prepare: Callable[[], Job]
    sink: Sink
    job: Job | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


class EngineLoop:
    def __init__(self, generator: Generator, name: str = "trellis-engine") -> None:
        self.generator = generator
        self._cond = threading.Condition()
        self._inbox: list[Ticket] = []
        self._cancels: list[Ticket] = []
        self._running: dict[Job, Ticket] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0  # forward steps run (statistics)

    # -- callers (any thread) ----------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, prepare: Callable[[], Job], sink: Sink) -> Ticket:
        ticket = Ticket(prepare, sink)
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine is shutting down")
            self._inbox.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (its client went away): its job leaves the batch at the next step and
        its pages go back. Its sink is not called again."""
        with self._cond:
            ticket.cancelled = True
            self._cancels.append(ticket)
            self._cond.notify()

    @property
    def active_requests(self) -> int:
        return len(self._running)

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread; jobs still waiting or running get :class:`EngineClosedError`."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the loop's thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._running or self._closing):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                closing = self._closing
            if closing:
                self._fail_all(EngineClosedError("the engine is shutting down"), inbox)
                return
            for ticket in cancels:
                if ticket.job is not None and self._running.pop(ticket.job, None) is not None:
                    self.generator.cancel(ticket.job)
            for ticket in inbox:
                self._admit(ticket)
            if self._running:
                self._step()

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            return
        try:
            job = ticket.prepare()
            self.generator.enqueue(job)
        except Exception as exc:  # the request's fault (or a broken template): its sink says why
            ticket.sink(exc)
            return
        ticket.job = job
        self._running[job] = ticket
        ticket.sink(ACCEPTED)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            results = self.generator.iterate()
        except Exception as exc:  # a failed forward step: no running job can trust its state
            self._fail_all(exc, [])
            return
        self.steps += 1
        if not results and time.perf_counter() - started < IDLE_STEP_S:
            time.sleep(IDLE_STEP_S)  # nothing ran (jobs wait for pages others hold): do not spin
        for result in results:
            ticket = self._running.get(result.job)
            if ticket is None:
                continue  # cancelled after this step started
            if result.done:
                del self._running[result.job]
            ticket.sink(result)

    def _fail_all(self, exc: BaseException, waiting: list[Ticket]) -> None:
        for job, ticket in list(self._running.items()):
            self.generator.cancel(job)
            ticket.sink(exc)
        self._running.clear()
        for ticket in waiting:
            if not ticket.cancelled:
                ticket.sink(exc)
