"""A request's job as an async stream of results, on the server's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.generation.job import Job, JobResult
from engine.serve.engine_loop import ACCEPTED, EngineClosedError, EngineLoop
from engine.serve.errors import APIError, from_engine_error

_CLOSED = object()  # wakes a reader whose job was cancelled (no result will come)
DISCONNECT_POLL_S = 0.5


class JobStream:
    """Submit ``prepare`` to ``engine`` and read its results here. :meth:`accepted` waits until
    the job is enqueued (raising the :class:`APIError` for a refused one), then iterating yields
    the job's results up to the last. Leaving early (a client that went away) cancels the job."""

    def __init__(self, engine: EngineLoop, prepare: Callable[[], Job]) -> None:
        self._engine = engine
        self._prepare = prepare
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ticket = None
        self._over = False

    async def accepted(self) -> None:
        loop = asyncio.get_running_loop()

        def sink(item) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody to tell
                pass

        try:
            self._ticket = self._engine.submit(self._prepare, sink)
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type="server_error") from None
        item = await self._next()
        if item is not ACCEPTED:
            raise APIError(500, f"unexpected engine event {item!r}", type="server_error")

    async def results(self) -> AsyncIterator[JobResult]:
        try:
            while not self._over:
                result = await self._next()
                if result is _CLOSED:
                    return
                if result.done:
                    self._over = True
                yield result
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the job unless it is over (safe to call more than once)."""
        if not self._over and self._ticket is not None:
            self._over = True
            self._engine.cancel(self._ticket)
            self._queue.put_nowait(_CLOSED)

    async def collect(self, request, feed: Callable[[JobResult], object]) -> bool:
        """Feed every result to ``feed`` (a whole, non-streamed reply), cancelling the job if the
        client disconnects meanwhile (a client that timed out and retries must not leave its
        first job running). True when the job ran to its end."""

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            self.close()

        watcher = asyncio.create_task(watch())
        ended = False
        try:
            async for result in self.results():
                feed(result)
                ended = result.done
        finally:
            watcher.cancel()
        return ended

    async def _next(self):
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._over = True
            raise from_engine_error(item)
        return item
