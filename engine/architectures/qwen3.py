"""Qwen3: Llama with a per-head RMSNorm on queries and keys before RoPE."""

from engine.architectures.base import Architecture


class Qwen3(Architecture):
    hf_names = ("Qwen3ForCausalLM",)
    qk_norm = True
