"""An OpenAI-compatible HTTP server over the engine's Generator (``python -m engine serve``).

Layers, top down: :mod:`~engine.serve.app` (Starlette routes, API key, errors in OpenAI's shape)
-> :mod:`~engine.serve.chat` / :mod:`~engine.serve.completions` (one request: read, check, stream
the reply) -> :mod:`~engine.serve.server` (what they share: the session, building jobs) ->
:mod:`~engine.serve.engine_loop` (one thread drives the Generator: every client's job in one
continuous batch). :mod:`~engine.serve.runner` runs it all under uvicorn.

Nothing here is imported by the rest of the engine: the HTTP stack (starlette, uvicorn) loads
only when a server is made.
"""
