"""How much context a model is loaded with: the one number the load and the memory estimate share.

The engine allocates the KV cache for the context it is asked for (``ChatSession.load``'s
``cache_tokens``), and a model cannot use more than its own ``max_position_embeddings``. The
app asks for the user's limit (``engine.context_length``, 8,192 tokens by default), or the model's
own when that is smaller; the library's "will it fit" estimate uses the same function, so it
is the memory of the load it describes.
"""

from __future__ import annotations

DEFAULT_CONTEXT = 8192


def load_context(model_context: int | None, limit: int = DEFAULT_CONTEXT) -> int:
    """Tokens of context for a model whose own limit is ``model_context`` (None: unknown)."""
    return min(int(model_context), int(limit)) if model_context else int(limit)
