"""Ernie 4.5 MoE (Ernie4_5_MoeForCausalLM): the dense Ernie 4.5's attention and MLPs (RoPE on
adjacent pairs; with ``use_bias``, biases on every projection of attention, dense MLPs and shared
experts and on the head, none on the routed experts; a tied head by default). A layer holds
experts where ``(i + 1) % moe_layer_interval == 0`` between ``moe_layer_start_index`` and
``moe_layer_end_index`` (-1: the last layer); the others keep a dense MLP. Its router takes a
softmax over the experts, chooses by the probabilities plus a correction bias (stored as one row
under ``mlp.moe_statics``; ``moe_use_aux_free``) and weighs the chosen experts by their
renormalised probabilities; ``moe_num_shared_experts`` ungated shared experts of
``moe_intermediate_size`` each run as one MLP. The multi-token-prediction weights stored beside
the layers are not read."""

from __future__ import annotations

from dataclasses import replace

from engine.architectures.base import TensorNames
from engine.architectures.ernie4_5 import Ernie4_5
from engine.architectures.expert_layers import with_experts
from engine.config import ModelConfig
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.layers.spec import ModelSpec

ERNIE_EXPERTS = SparseMoENames(
    selection_bias="mlp.moe_statics.e_score_correction_bias",
    selection_bias_row=True,
    shared_expert="mlp.shared_experts",
)


class Ernie4_5_Moe(Ernie4_5):
    hf_names = ("Ernie4_5_MoeForCausalLM",)
    names = TensorNames(parts=(ERNIE_EXPERTS,))

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        n, bias = int(cfg.require("num_hidden_layers")), bool(cfg.get("use_bias", False))
        start = int(cfg.get("moe_layer_start_index", 1))
        end = int(cfg.get("moe_layer_end_index", -1))
        end = n - 1 if end == -1 else end
        interval = int(cfg.get("moe_layer_interval", 1))
        width = int(cfg.require("moe_intermediate_size"))
        moe = SparseMoESpec(
            num_experts=int(cfg.get("moe_num_experts") or cfg.require("num_experts")),
            experts_per_token=int(cfg.get("moe_k") or cfg.require("num_experts_per_tok")),
            intermediate_size=width,
            normalize=True,
            activation=cfg.get("hidden_act") or "silu",
            shared_expert_size=width * int(cfg.get("moe_num_shared_experts", 2)),
            shared_expert_gate=False,
            shared_expert_bias=bias,
            scoring="softmax",
            selection_bias=bool(cfg.get("moe_use_aux_free", True)),
        )

        def sparse(i: int) -> bool:
            return (i + 1) % interval == 0 and start <= i <= end

        return with_experts(replace(super().spec(cfg), head_bias=bias), cfg, moe, sparse)
