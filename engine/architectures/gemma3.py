"""Gemma 3 (text): Gemma 2 with q/k norms instead of attention soft-capping, five sliding layers
per full one, and a separate RoPE base for sliding layers (``rope_local_base_freq``)."""

from dataclasses import replace

from engine.architectures.base import FULL, SLIDING
from engine.architectures.gemma2 import Gemma2
from engine.config import ModelConfig
from engine.modules.rope import RopeSpec


class Gemma3(Gemma2):
    hf_names = ("Gemma3ForCausalLM",)
    qk_norm = True

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        n = int(cfg.require("num_hidden_layers"))
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        specs = super().rope_specs(cfg)
        local = cfg.get("rope_local_base_freq")
        if local is not None and cfg.get("rope_parameters") is None:
            # transformers 4 configs: the sliding layers' base is a separate field, unscaled.
            specs[SLIDING] = replace(specs[FULL], theta=float(local), kind="default", params={})
        return specs
