"""Phi-3: fused ``qkv_proj`` and ``gate_up_proj`` matrices, sliding window on every layer."""

from engine.architectures.base import TensorNames
from engine.architectures.mistral import Mistral
from engine.layers.attention import AttentionNames
from engine.layers.gated_mlp import GatedMLPNames


class Phi3(Mistral):
    hf_names = ("Phi3ForCausalLM",)
    names = TensorNames(
        parts=(
            AttentionNames(qkv_fused="self_attn.qkv_proj"),
            GatedMLPNames(gate_up_fused="mlp.gate_up_proj"),
        )
    )
