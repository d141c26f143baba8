"""The Hugging Face architectures the engine runs, as plain names.

Kept apart from ``engine.architectures`` (which builds torch modules) so that code that must stay
torch-free - the Hub browser, the model library's inspector, the GUI thread - can filter by it.
``tests/engine/test_supported.py`` checks it against the architecture registry.
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
        # mixture of experts
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        # vision-language (image + text)
        "Gemma3ForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
    }
)


def is_supported(architectures: Iterable[str] | None) -> bool:
    """True when any of a config's ``architectures`` is one the engine runs."""
    return any(a in SUPPORTED_ARCHITECTURES for a in (architectures or ()))
