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
        "MiMoForCausalLM",
        "IQuestCoderForCausalLM",
        "HyperCLOVAXForCausalLM",
        "NanoChatForCausalLM",
        "DeciLMForCausalLM",  # Nemotron-NAS: per-layer shapes
        "Ernie4_5ForCausalLM",
        "ArceeForCausalLM",
        "SeedOssForCausalLM",
        "ApertusForCausalLM",
        "Glm4ForCausalLM",
        "Exaone4ForCausalLM",
        "Olmo3ForCausalLM",
        "CohereForCausalLM",
        "Cohere2ForCausalLM",
        # mixture of experts
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        "GptOssForCausalLM",  # with attention sinks; MXFP4 experts read dequantized
        "AfmoeForCausalLM",
        "Step3p5ForCausalLM",
        "Step3p7ForConditionalGeneration",  # its text decoder (no images)
        "Glm4MoeForCausalLM",
        "Dots1ForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "SolarOpenForCausalLM",
        # multi-head latent attention (a compressed KV cache) and mixtures of experts
        "DeepseekV3ForCausalLM",
        # vision-language (image + text)
        "Gemma3ForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Glm4vForConditionalGeneration",
        "Glm4vMoeForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        # Gemma 4: text and images (its small sizes' audio is refused)
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
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
