"""Running an :class:`~engine.serve.server.OpenAIServer` under uvicorn: in the foreground (the
``serve`` command) or on a background thread (tests, ``bench-serve``), on a given port or on a
free one the system picks (port 0; the bound port is read back)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import uvicorn

from engine.serve.server import OpenAIServer


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling ``on_ready`` the address it bound once it listens."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str, int], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self.address: tuple[str, int] | None = None
        self.interrupted = False  # stopped by Ctrl-C (SIGINT)

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn re-raises the signal once it has shut down, but whether that surfaces as a
        # KeyboardInterrupt depends on where asyncio's own SIGINT handling stands at that moment:
        # remember it, so the command's exit status does not.
        self.interrupted = self.interrupted or sig == signal.SIGINT
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.address = (host, port)
            if self._on_ready is not None:
                self._on_ready(host, port)


def _config(server: OpenAIServer, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        lifespan="off",  # the engine loop is started and stopped here, around uvicorn
        timeout_graceful_shutdown=5,
    )


def serve_forever(
    server: OpenAIServer,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str, int], None] | None = None,
    log_level: str = "warning",
) -> bool:
    """Serve until stopped (Ctrl-C: uvicorn finishes the requests in flight, then returns);
    True where Ctrl-C stopped it."""
    server.start()
    uvicorn_server = _Uvicorn(_config(server, host, port, log_level), on_ready)
    try:
        uvicorn_server.run()
    finally:
        server.close()
    return uvicorn_server.interrupted


class BackgroundServer:
    """``with BackgroundServer(server) as bg: bg.base_url`` - the server on a thread of this
    process, on a free port of ``host``, until the block ends."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self._uvicorn = _Uvicorn(_config(server, host, port, "warning"), None)
        self._thread = threading.Thread(target=self._uvicorn.run, name="trellis-http", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._uvicorn.address or ("", 0)
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> BackgroundServer:
        self.server.start()
        self._thread.start()
        while self._uvicorn.address is None:
            self._thread.join(0.02)
            if not self._thread.is_alive():
                self.server.close()
                raise RuntimeError("the HTTP server did not start (is the port taken?)")
        return self

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self.server.close()
