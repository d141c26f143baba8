"""HyperCLOVA X SEED (HyperCLOVAXForCausalLM, the Think 14B): Granite's μP multipliers on a Llama
decoder with Peri-Layer Normalization.

- each sub-layer's output is normalised again (``post_norm1`` after attention, ``post_norm2``
  after the MLP) before it joins the residual stream, unless ``use_post_norm`` is false;
- that output is multiplied by ``residual_multiplier`` as it joins the stream;
- the embeddings are multiplied by ``embedding_multiplier`` and the logits by ``logits_scaling``
  (a multiplier here, where Granite divides);
- the attention logits are scaled by ``attention_multiplier`` (default ``head_dim ** -0.5``).
"""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import Architecture, TensorNames
from engine.config import ModelConfig
from engine.layers.attention import AttentionSpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec


class HyperCLOVAX(Architecture):
    hf_names = ("HyperCLOVAXForCausalLM",)
    names = TensorNames(mixer_out_norm="post_norm1", feed_forward_out_norm="post_norm2")

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)
        post_norms = bool(cfg.get("use_post_norm", True))
        residual = float(cfg.get("residual_multiplier", 1.0))
        layers = tuple(
            replace(layer, sandwich_norms=post_norms, residual_scale=residual) for layer in spec.layers
        )
        return replace(
            spec,
            layers=layers,
            embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
            logit_scale=float(cfg.get("logits_scaling", 1.0)),
        )

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        spec = super().attention(cfg, layer_type, rope)
        return replace(spec, scale=float(cfg.get("attention_multiplier") or spec.scale))
