"""Mistral: Llama with a sliding attention window on every layer (when the config sets one)."""

from engine.architectures.base import FULL, SLIDING, Architecture
from engine.config import ModelConfig


class Mistral(Architecture):
    hf_names = ("MistralForCausalLM",)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        kind = SLIDING if cfg.get("sliding_window") else FULL
        return [kind] * int(cfg.require("num_hidden_layers"))
