"""Serve › Serve the loaded model: the app's own model behind the OpenAI-compatible server
(``engine.serve``) on 127.0.0.1, sharing the app's engine (``app.serve.host``, run by the worker
on the engine side), and the window's switch and address (``app.serve.status``)."""
