"""Phi-3: fused ``qkv_proj`` and ``gate_up_proj`` matrices, sliding window on every layer."""

from engine.architectures.base import TensorNames
from engine.architectures.mistral import Mistral


class Phi3(Mistral):
    hf_names = ("Phi3ForCausalLM",)
    names = TensorNames(qkv_fused="self_attn.qkv_proj", gate_up_fused="mlp.gate_up_proj")
