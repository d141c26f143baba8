"""Qwen3-Next (Qwen3NextForCausalLM): Qwen3 made a hybrid. Most layers are gated delta nets
(``linear_attention``), every ``full_attention_interval``-th one attention whose ``q_proj`` also
gives a sigmoid gate per head, with RoPE on part of each head (``partial_rotary_factor``). Norms
scale by ``1 + weight``; the MLPs are mixtures of experts with a shared expert."""

from dataclasses import replace
from typing import ClassVar

from engine.architectures.base import FULL, ModelSpec, mixture_of_experts
from engine.architectures.mtp_names import QWEN3_NEXT_MTP
from engine.architectures.qwen3 import Qwen3
from engine.config import ModelConfig
from engine.layers.gated_delta_net import GatedDeltaNetSpec
from engine.layers.spec import MixerSpec
from engine.modules.rope import RopeSpec

LINEAR = "linear_attention"


def linear_attention(cfg: ModelConfig, **settings) -> GatedDeltaNetSpec:
    """The gated delta net of a ``linear_attention`` layer, from the ``linear_*`` fields;
    ``settings`` give the spec's other fields, or override these."""
    fields = dict(
        num_k_heads=int(cfg.require("linear_num_key_heads")),
        num_v_heads=int(cfg.require("linear_num_value_heads")),
        k_head_dim=int(cfg.require("linear_key_head_dim")),
        v_head_dim=int(cfg.require("linear_value_head_dim")),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )
    return GatedDeltaNetSpec(**{**fields, **settings})


class Qwen3NextHybrid(Qwen3):
    """What Qwen3-Next and Qwen3.5 share: gated delta nets beside gated attention, ``1 + w``
    norms. ``head_grouped``: the delta nets' projections are Qwen3-Next's fused ones."""

    head_grouped: ClassVar[bool] = False
    mtp = QWEN3_NEXT_MTP

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        n, interval = int(cfg.require("num_hidden_layers")), int(cfg.get("full_attention_interval", 4))
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]

    def mixer(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> MixerSpec:
        if layer_type == LINEAR:
            return linear_attention(cfg, head_grouped=self.head_grouped)
        return replace(self.attention(cfg, layer_type, rope), output_gate=True)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return replace(super().spec(cfg), norm_offset=1.0)


class Qwen3Next(Qwen3NextHybrid):
    hf_names = ("Qwen3NextForCausalLM",)
    head_grouped = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return mixture_of_experts(super().spec(cfg), cfg, normalize=True)
