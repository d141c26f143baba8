"""Gemma 2: the Gemma family (see ``gemma_family``) plus "sandwich" norms around both
sub-layers, attention and final-logit soft-capping, and sliding/full layers alternating."""

from engine.architectures.base import FULL, SLIDING, Architecture, ModelSpec, TensorNames, gemma_family
from engine.config import ModelConfig

SANDWICH = TensorNames(
    mixer_out_norm="post_attention_layernorm",
    feed_forward_norm="pre_feedforward_layernorm",
    feed_forward_out_norm="post_feedforward_layernorm",
)


class Gemma2(Architecture):
    hf_names = ("Gemma2ForCausalLM",)
    names = SANDWICH
    sandwich_norms = True
    default_tie = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return gemma_family(super().spec(cfg), cfg)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        n = int(cfg.require("num_hidden_layers"))
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
