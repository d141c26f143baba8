"""LFM2 (Liquid AI): a hybrid of gated short convolutions (layer type "conv") and grouped-query
attention with per-head q/k RMSNorm ("full_attention"), every layer followed by a SwiGLU MLP.

Its names differ from Llama's throughout: ``operator_norm`` and ``ffn_norm`` before the mixer and
the MLP, ``self_attn.out_proj``, ``q_layernorm`` / ``k_layernorm``, the MLP's ``w1`` (gate), ``w3``
(up) and ``w2`` (down) under ``feed_forward``, and the final norm ``embedding_norm`` (it follows
the last layer, whatever its name says). Configs list the layers in ``layer_types``, or only the
attention ones in ``full_attn_idxs``.
"""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import FULL, Architecture, TensorNames
from engine.config import ModelConfig
from engine.layers.attention import AttentionNames
from engine.layers.gated_mlp import GatedMLPNames, GatedMLPSpec
from engine.layers.short_conv import ShortConvSpec
from engine.layers.spec import MixerSpec, ModelSpec
from engine.modules.rope import RopeSpec

CONV = "conv"

LFM2_NAMES = TensorNames(
    final_norm="embedding_norm",
    mixer_norm="operator_norm",
    feed_forward_norm="ffn_norm",
    parts=(
        AttentionNames(
            o="self_attn.out_proj", q_norm="self_attn.q_layernorm", k_norm="self_attn.k_layernorm"
        ),
        GatedMLPNames(gate="feed_forward.w1", up="feed_forward.w3", down="feed_forward.w2"),
    ),
)


def feed_forward_size(cfg: ModelConfig) -> int:
    """The MLP's width. With ``block_auto_adjust_ff_dim`` the configured width (``block_ff_dim``
    in the Hub's configs) is that of a plain two-matrix MLP: a SwiGLU of the same cost is 2/3 as
    wide, then scaled by ``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of``."""
    width = int(cfg.get("block_ff_dim") or cfg.require("intermediate_size"))
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    multiple = int(cfg.get("block_multiple_of", 256))
    return multiple * -(-int(multiplier * width) // multiple)


class Lfm2(Architecture):
    hf_names = ("Lfm2ForCausalLM",)
    names = LFM2_NAMES
    qkv_bias = False
    qk_norm = True
    default_tie = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)
        # The Hub's configs spell two fields their own way (transformers reads both).
        tie = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", self.default_tie))
        return replace(spec, norm_eps=float(cfg.get("norm_eps", 1e-5)), tie_word_embeddings=bool(tie))

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Attention at ``full_attn_idxs`` (every layer where it is missing), convolutions
        elsewhere."""
        n = int(cfg.require("num_hidden_layers"))
        attention = cfg.get("full_attn_idxs")
        attending = set(range(n)) if attention is None else {int(i) for i in attention}
        return [FULL if i in attending else CONV for i in range(n)]

    def mixer(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> MixerSpec:
        if layer_type == CONV:
            return ShortConvSpec(
                hidden_size=int(cfg.require("hidden_size")),
                kernel_size=int(cfg.get("conv_L_cache", 3)),
                bias=bool(cfg.get("conv_bias", False)),
            )
        return super().mixer(cfg, layer_type, rope)

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        return GatedMLPSpec(feed_forward_size(cfg), "silu")
