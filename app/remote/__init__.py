"""Remote engines: OpenAI-compatible servers (vLLM, llama.cpp's llama-server, SGLang, TabbyAPI,
Ollama, another Trellis Chat's ``serve``) whose models the app chats with as with local ones.

A remote model is named by a reference (:mod:`app.remote.refs`); loading one gives the worker a
:class:`~app.remote.session.RemoteSession`, which speaks the engine's ``SessionProtocol`` over
HTTP, so chats, regenerate, stop, system prompts, tools and images take the same path as local
models. API keys live in the system keyring (:mod:`app.remote.keys`), never in the database or
the logs.
"""
