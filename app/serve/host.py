"""The local server over the worker's loaded session (engine side: the worker imports this
lazily, as it does the engine's runtime).

:class:`LocalServer` builds an ``OpenAIServer`` on the session the app already holds (one model,
one cache), runs it under uvicorn on a thread of its own, bound to 127.0.0.1 only, and routes the
app's own replies through the same engine loop (``engine.serve.shared``), so chats and HTTP
clients share one continuous batch. ``close`` stops the HTTP side, gives the session its
Generator back and ends the loop.
"""

from __future__ import annotations

from typing import Any

from engine.serve.runner import BackgroundServer
from engine.serve.server import OpenAIServer, ServeOptions
from engine.serve.shared import share_session

HOST = "127.0.0.1"


class LocalServer:
    def __init__(self, session: Any, port: int) -> None:
        if not hasattr(session, "generator") or not hasattr(session, "tokenizer"):
            raise TypeError("only a model loaded on this machine can be served")
        self.session = session
        self.server = OpenAIServer(session, ServeOptions())
        self._background = BackgroundServer(self.server, host=HOST, port=port)
        self._restore = None

    @property
    def base_url(self) -> str:
        return self._background.base_url

    @property
    def model_name(self) -> str:
        return self.server.model_name

    def start(self) -> LocalServer:
        self._background.__enter__()  # starts the engine loop, then uvicorn; raises if the port is taken
        self._restore = share_session(self.session, self.server.engine)
        return self

    def close(self) -> None:
        self._background.__exit__(None, None, None)  # the HTTP side first: no new requests
        if self._restore is not None:
            self._restore()
            self._restore = None
