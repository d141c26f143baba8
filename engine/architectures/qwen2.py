"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj)."""

from engine.architectures.base import Architecture


class Qwen2(Architecture):
    hf_names = ("Qwen2ForCausalLM",)
    qkv_bias = True
