"""NemotronH (Nemotron-H, Nemotron Nano 2, Nemotron 3): a hybrid whose every layer is a single
block, one of a Mamba-2 mixer (``M``), attention without positional encoding (``*``), a
squared-ReLU MLP (``-``) or a mixture of squared-ReLU experts (``E``), each with its own pre-norm
and residual. The layer kinds come from ``hybrid_override_pattern`` (the Hub's configs) or
``layers_block_type`` (transformers 5's).

Every block keeps its weights under ``backbone.layers.{i}.mixer`` (whatever its kind) and its
norm under ``backbone.layers.{i}.norm``; EXL3 conversions keep these names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.architectures.base import FULL, Architecture, TensorNames
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionNames, AttentionSpec
from engine.layers.mamba2 import Mamba2Spec
from engine.layers.plain_mlp import PlainMLPNames, PlainMLPSpec
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec
from engine.layers.spec import LayerSpec, ModelSpec

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
# transformers 5's names of the blocks (and the older ones it still reads), as pattern letters
_BLOCK_TYPES = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}


def _number(value: Any) -> float:
    """A number of config.json, also as transformers 5 writes non-finite ones
    (``{"__float__": "Infinity"}``)."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class NemotronH(Architecture):
    hf_names = ("NemotronHForCausalLM",)
    qkv_bias = False
    names = TensorNames(
        prefix="backbone.",
        embed="embeddings",
        final_norm="norm_f",
        mixer_norm="norm",
        feed_forward_norm="norm",
        parts=(
            AttentionNames(q="mixer.q_proj", k="mixer.k_proj", v="mixer.v_proj", o="mixer.o_proj"),
            PlainMLPNames(up="mixer.up_proj", down="mixer.down_proj"),
            SparseMoENames(
                router="mixer.gate",
                selection_bias="mixer.gate.e_score_correction_bias",
                expert_up="mixer.experts.{e}.up_proj",
                expert_down="mixer.experts.{e}.down_proj",
                experts_fused="mixer.experts",
                shared_expert="mixer.shared_experts",
                latent_in="mixer.fc1_latent_proj",
                latent_out="mixer.fc2_latent_proj",
            ),
        ),
    )

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        blocks = {
            MAMBA: lambda: LayerSpec(self.mamba2(cfg), None),
            ATTENTION: lambda: LayerSpec(self.nope_attention(cfg), None),
            MLP: lambda: LayerSpec(None, self.plain_mlp(cfg)),
            MOE: lambda: LayerSpec(None, self.experts(cfg)),
        }
        return ModelSpec(
            vocab_size=int(cfg.require("vocab_size")),
            hidden_size=int(cfg.require("hidden_size")),
            max_position_embeddings=cfg.context_length,
            layers=tuple(blocks[kind]() for kind in self.block_pattern(cfg)),
            norm_eps=float(cfg.get("layer_norm_epsilon") or cfg.get("rms_norm_eps") or 1e-5),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def block_pattern(self, cfg: ModelConfig) -> str:
        """One letter per layer: ``M``, ``*``, ``-`` or ``E``."""
        where = cfg.directory / "config.json"
        types = cfg.get("layers_block_type") or cfg.get("layer_types")
        if types:
            unknown = sorted({t for t in types if t not in _BLOCK_TYPES})
            if unknown:
                raise ModelLoadError(f"{where}: unsupported NemotronH block types {unknown}")
            pattern = "".join(_BLOCK_TYPES[t] for t in types)
        else:
            pattern = str(cfg.require("hybrid_override_pattern"))
            layers = cfg.get("num_hidden_layers")
            if layers is not None and int(layers) != len(pattern):
                raise ModelLoadError(
                    f"{where}: hybrid_override_pattern has {len(pattern)} layers, num_hidden_layers {layers}"
                )
        unknown = sorted(set(pattern) - set(_BLOCK_TYPES.values()))
        if unknown:
            raise ModelLoadError(f"{where}: unknown NemotronH block letters {unknown} in '{pattern}'")
        return pattern

    def mamba2(self, cfg: ModelConfig) -> Mamba2Spec:
        if (cfg.get("mamba_hidden_act") or "silu") != "silu":
            raise ModelLoadError(f"{cfg.directory / 'config.json'}: Mamba-2 activation must be silu")
        limit = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, math.inf)
        low, high = (_number(v) for v in limit)
        return Mamba2Spec(
            num_heads=int(cfg.require("mamba_num_heads")),
            head_dim=int(cfg.require("mamba_head_dim")),
            groups=int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1),
            state_size=int(cfg.require("ssm_state_size")),
            conv_kernel=int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4),
            conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
            proj_bias=bool(cfg.get("use_bias", False)),
            chunk_size=int(cfg.get("chunk_size") or cfg.get("mamba_chunk_size") or 128),
            # softplus is positive: (0, inf) clamps nothing
            dt_limit=None if (low, high) == (0.0, math.inf) else (low, high),
            norm_eps=float(cfg.get("layer_norm_epsilon") or 1e-5),
        )

    def nope_attention(self, cfg: ModelConfig) -> AttentionSpec:
        """Attention with no positional encoding: order reaches it through the Mamba-2 layers."""
        spec = self.attention(cfg, FULL, rope=None)
        head_dim = cfg.get("head_dim") or cfg.get("attention_head_dim")
        if head_dim is not None and int(head_dim) != spec.head_dim:
            spec = replace(spec, head_dim=int(head_dim), scale=int(head_dim) ** -0.5)
        return spec

    def plain_mlp(self, cfg: ModelConfig) -> PlainMLPSpec:
        return PlainMLPSpec(
            intermediate_size=int(cfg.require("intermediate_size")),
            activation=cfg.get("mlp_hidden_act") or "relu2",
            bias=bool(cfg.get("mlp_bias", False)),
        )

    def experts(self, cfg: ModelConfig) -> SparseMoESpec:
        """Nemotron 3's MoE: squared-ReLU experts (optionally in a smaller latent width) chosen by
        sigmoid scores plus a correction bias, among each token's best groups, weighted by the
        renormalised scores times ``routed_scaling_factor``; one ungated shared expert."""
        return SparseMoESpec(
            num_experts=int(cfg.require("n_routed_experts")),
            experts_per_token=int(cfg.require("num_experts_per_tok")),
            intermediate_size=int(cfg.require("moe_intermediate_size")),
            normalize=bool(cfg.get("norm_topk_prob", True)),
            activation=cfg.get("mlp_hidden_act") or "relu2",
            shared_expert_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0),
            shared_expert_gate=False,
            gated=False,
            scoring="sigmoid",
            selection_bias=True,
            routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
            num_groups=int(cfg.get("n_group") or 1),
            groups_per_token=int(cfg.get("topk_group") or 1),
            latent_size=int(cfg.get("moe_latent_size") or 0),
        )

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        # transformers 5 names the backbone "model" in memory; a checkpoint saved from it without
        # the conversion back keeps that name.
        if not has("backbone.embeddings.weight") and has("model.embeddings.weight"):
            return replace(self.names, prefix="model.")
        return self.names
