"""The Hugging Face architectures (``config.json`` ``architectures[0]``) the engine can run.

This is the one list the hub browser filters on. The engine lead may later derive it from
``engine.architectures`` (one module per family); until then it lives here so that the Hub code does
not import the model code (which pulls in torch) just to filter search results.
"""

from __future__ import annotations

from collections.abc import Iterable

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "SmolLM3ForCausalLM",
    }
)


def is_supported(architectures: Iterable[str] | None) -> bool:
    """True when any of a config's ``architectures`` is one the engine runs."""
    return any(a in SUPPORTED_ARCHITECTURES for a in (architectures or ()))
