"""The Hugging Face architectures the engine runs, as plain names: the one list every torch-free
caller reads (the Hub browser and ``search --supported``, the model library's inspector, the GUI
thread).

The architecture registry (``engine.architectures.REGISTRY``) is what really decides: it maps each
name to the class that reads that family's config. It cannot be read from here at import time,
because importing it builds the module library and so imports torch (seconds, and never on the
GUI thread). So the names are written out once below, and :func:`registry_architectures` - the one
place that reads the registry - lets ``tests/engine/test_supported.py`` fail the moment the two
differ.
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
        # hybrids of attention and recurrent layers
        "NemotronHForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "OlmoHybridForCausalLM",
    }
)


def is_supported(architectures: Iterable[str] | None) -> bool:
    """True when any of a config's ``architectures`` is one the engine runs."""
    return any(a in SUPPORTED_ARCHITECTURES for a in (architectures or ()))


def registry_architectures() -> frozenset[str]:
    """The names the architecture registry maps to a family class. Imports torch: for the check
    against :data:`SUPPORTED_ARCHITECTURES` and for callers that load models anyway."""
    from engine.architectures import REGISTRY  # deferred: the registry pulls in torch

    return frozenset(REGISTRY)
