"""One small file per Hugging Face architecture family; this module maps names to them."""

from __future__ import annotations

from engine.architectures.afmoe import Afmoe
from engine.architectures.apertus import Apertus
from engine.architectures.arcee import Arcee
from engine.architectures.base import Architecture, TensorNames
from engine.architectures.cohere import Cohere, Cohere2
from engine.architectures.deci import Deci
from engine.architectures.deepseek_v3 import DeepseekV3
from engine.architectures.dots1 import Dots1
from engine.architectures.ernie4_5 import Ernie4_5
from engine.architectures.ernie4_5_moe import Ernie4_5_Moe
from engine.architectures.exaone4 import Exaone4
from engine.architectures.gemma2 import Gemma2
from engine.architectures.gemma3 import Gemma3
from engine.architectures.gemma3_vl import Gemma3VL
from engine.architectures.gemma4 import Gemma4
from engine.architectures.gemma4_vl import Gemma4VL
from engine.architectures.glm4 import Glm4
from engine.architectures.glm4_moe import Glm4Moe
from engine.architectures.glm4v import Glm4v
from engine.architectures.glm4v_moe import Glm4vMoe
from engine.architectures.gpt_oss import GptOss
from engine.architectures.hyperclovax import HyperCLOVAX
from engine.architectures.iquest_coder import IQuestCoder
from engine.architectures.lfm2 import Lfm2
from engine.architectures.lfm2_moe import Lfm2Moe
from engine.architectures.llama import Llama
from engine.architectures.mimo import MiMo
from engine.architectures.minimax_m2 import MiniMaxM2
from engine.architectures.mistral import Mistral
from engine.architectures.mistral3 import Mistral3
from engine.architectures.mixtral import Mixtral
from engine.architectures.nanochat import NanoChat
from engine.architectures.nemotron_h import NemotronH
from engine.architectures.olmo3 import Olmo3
from engine.architectures.olmo_hybrid import OlmoHybrid
from engine.architectures.phi3 import Phi3
from engine.architectures.qwen2 import Qwen2
from engine.architectures.qwen2_5_vl import Qwen2_5_VL
from engine.architectures.qwen2_moe import Qwen2Moe
from engine.architectures.qwen3 import Qwen3
from engine.architectures.qwen3_5 import Qwen3_5, Qwen3_5VL
from engine.architectures.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeVL
from engine.architectures.qwen3_moe import Qwen3Moe
from engine.architectures.qwen3_next import Qwen3Next
from engine.architectures.qwen3_vl import Qwen3VL
from engine.architectures.qwen3_vl_moe import Qwen3VLMoe
from engine.architectures.seed_oss import SeedOss
from engine.architectures.smollm3 import SmolLM3
from engine.architectures.solar_open import SolarOpen
from engine.architectures.step3p7 import Step3p7
from engine.errors import UnsupportedArchitectureError
from engine.layers import LayerSpec, ModelSpec

_FAMILIES: list[type[Architecture]] = [Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3, SmolLM3]
_FAMILIES += [MiMo, IQuestCoder, HyperCLOVAX, NanoChat]  # Llama and Qwen2 variants
_FAMILIES += [Ernie4_5, Arcee, SeedOss, Apertus]  # Llama variants: RoPE pairs, biases, MLPs without a gate
_FAMILIES += [Glm4, Exaone4, Olmo3]  # norms after the sub-layers (sandwich or post-norm)
_FAMILIES += [Cohere, Cohere2]  # attention and MLP side by side, LayerNorm
_FAMILIES += [Deci]  # per-layer KV heads and MLP widths, layers without attention or MLP
_FAMILIES += [Qwen3Moe, Qwen2Moe, Mixtral]  # mixture of experts
_FAMILIES += [GptOss]  # mixture of experts with attention sinks
# mixture of experts, sigmoid or biased routers
_FAMILIES += [Glm4Moe, Dots1, MiniMaxM2, Ernie4_5_Moe, SolarOpen]
_FAMILIES += [DeepseekV3]  # multi-head latent attention and mixtures of experts
_FAMILIES += [Afmoe, Step3p7]  # mixture of experts with gated attention outputs
_FAMILIES += [Gemma3VL, Qwen2_5_VL, Qwen3VL, Mistral3]  # vision-language
_FAMILIES += [Glm4v]  # vision-language
_FAMILIES += [Qwen3VLMoe, Glm4vMoe]  # vision-language with mixtures of experts
# per-layer shapes and embeddings, shared keys and values, experts beside dense MLPs; with images
_FAMILIES += [Gemma4, Gemma4VL]
_FAMILIES += [NemotronH]  # hybrids of attention and Mamba-2
_FAMILIES += [Lfm2, Lfm2Moe]  # hybrids of attention and short convolutions
# hybrids of attention and gated delta nets
_FAMILIES += [Qwen3Next, Qwen3_5, Qwen3_5Moe, Qwen3_5VL, Qwen3_5MoeVL, OlmoHybrid]
REGISTRY: dict[str, type[Architecture]] = {name: cls for cls in _FAMILIES for name in cls.hf_names}


def architecture_for(name: str) -> Architecture:
    try:
        return REGISTRY[name]()
    except KeyError:
        supported = ", ".join(sorted(REGISTRY))
        raise UnsupportedArchitectureError(
            f"unknown architecture '{name}'; this engine supports: {supported}"
        ) from None


__all__ = [
    "Architecture",
    "LayerSpec",
    "ModelSpec",
    "TensorNames",
    "architecture_for",
]
