"""Llama (and every checkpoint saved as LlamaForCausalLM): the base reading, unchanged."""

from engine.architectures.base import Architecture


class Llama(Architecture):
    hf_names = ("LlamaForCausalLM",)
