"""Gemma 4 (text): Gemma's sandwich norms, sqrt(hidden)-scaled embeddings, tied head and final
soft-cap, with plain ``w`` norms (not ``1 + w``), q/k norms, values RMS-normalised without a
scale, a query scale of 1, and every layer's output multiplied by its ``layer_scalar``.

Sliding and full layers differ in shape: full layers have heads of ``global_head_dim``, with
``num_global_key_value_heads`` KV heads where their keys double as values
(``attention_k_eq_v``: no v_proj), and their own RoPE (proportional: a quarter of the pairs turn)
in ``rope_parameters`` per layer type. transformers 5.25 saves such per-layer shapes as
``per_layer_config`` (by layer index), which is read first.

The small sizes (E2B, E4B) add per-layer inputs (``hidden_size_per_layer_input``:
``engine.layers.per_layer_input``) and reuse keys and values: the last ``num_kv_shared_layers``
layers read those of the last earlier layer of their type (with MLPs twice as wide where
``use_double_wide_mlp``). The 26B-A4B runs a mixture of experts beside each dense MLP
(``enable_moe_block``: ``engine.layers.parallel_experts``).
"""

from __future__ import annotations

import math
from typing import Any

from engine.architectures.base import FULL, SLIDING, Architecture, TensorNames
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionSpec
from engine.layers.gated_mlp import GatedMLPSpec
from engine.layers.parallel_experts import ParallelExpertsSpec
from engine.layers.per_layer_input import PerLayerInputSpec
from engine.layers.sparse_moe import SparseMoESpec
from engine.layers.spec import FeedForwardSpec, LayerSpec, ModelSpec
from engine.modules.rope import RopeSpec

NAMES = TensorNames(
    mixer_out_norm="post_attention_layernorm",
    feed_forward_norm="pre_feedforward_layernorm",
    feed_forward_out_norm="post_feedforward_layernorm",
)

# transformers' defaults where config.json leaves them out
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM, DEFAULT_HEAD_DIM = 512, 256
DEFAULT_PER_LAYER_WIDTH, DEFAULT_VOCAB, DEFAULT_WINDOW = 256, 262_144, 512


def kv_sources(layer_types: list[str], shared: int, where: str = "config.json") -> dict[int, int]:
    """Each of the last ``shared`` layers mapped to the layer whose keys and values it reads: the
    last earlier (unshared) layer of its type."""
    n = len(layer_types)
    if not shared:
        return {}
    first = n - shared
    if first <= 0:
        raise ModelLoadError(f"{where}: num_kv_shared_layers {shared} leaves no layer to share from")
    producers = {
        kind: max(i for i in range(first) if layer_types[i] == kind) for kind in set(layer_types[:first])
    }
    missing = set(layer_types[first:]) - set(producers)
    if missing:
        raise ModelLoadError(f"{where}: no unshared layer of type {', '.join(sorted(missing))} to share from")
    return {i: producers[layer_types[i]] for i in range(first, n)}


class Gemma4(Architecture):
    hf_names = ("Gemma4ForCausalLM",)
    names = NAMES
    default_tie = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        where = str(cfg.directory / "config.json")
        if cfg.get("use_bidirectional_attention") == "all":
            raise ModelLoadError(f"{where}: Gemma 4 with bidirectional attention everywhere is not a decoder")
        types = self.layer_types(cfg)
        rope = self.rope_specs(cfg)
        sources = kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0), where)
        # transformers' default is per-layer inputs 256 wide; an explicit 0 or null turns them off
        width = int(cfg.text.get("hidden_size_per_layer_input", DEFAULT_PER_LAYER_WIDTH) or 0)
        layers = tuple(
            LayerSpec(
                self._attention(cfg, i, kind, rope[kind], sources.get(i)),
                self._feed_forward(cfg, i in sources),
                sandwich_norms=True,
                per_layer_input=width > 0,
                output_scale=True,
            )
            for i, kind in enumerate(types)
        )
        hidden = int(cfg.require("hidden_size"))
        activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        per_layer = None
        if width:
            vocab = int(cfg.get("vocab_size_per_layer_input", DEFAULT_VOCAB))
            per_layer = PerLayerInputSpec(vocab, width, int(cfg.get("pad_token_id") or 0), activation)
        return ModelSpec(
            vocab_size=int(cfg.require("vocab_size")),
            hidden_size=hidden,
            max_position_embeddings=cfg.context_length,
            layers=layers,
            norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            embed_scale=math.sqrt(hidden),
            final_softcap=cfg.get("final_logit_softcapping"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            per_layer_inputs=per_layer,
        )

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """As listed (else five sliding layers per full one); the last layer is always full, as
        transformers forces it."""
        n = int(cfg.require("num_hidden_layers"))
        types = list(cfg.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
        if len(types) != n or not set(types) <= {FULL, SLIDING}:
            raise ModelLoadError(
                f"{cfg.directory / 'config.json'}: layer_types must list {n} of {FULL}, {SLIDING}"
            )
        types[-1] = FULL
        return types

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        if cfg.get("rope_parameters") is None:
            cfg = ModelConfig(
                cfg.directory, cfg.architecture, cfg.raw, {**cfg.text, "rope_parameters": DEFAULT_ROPE}
            )
        return super().rope_specs(cfg)

    def _attention(
        self, cfg: ModelConfig, i: int, kind: str, rope: RopeSpec, source: int | None
    ) -> AttentionSpec:
        head_dim, kv_heads = _head_shape(cfg, i, kind)
        full, bias = kind == FULL, bool(cfg.get("attention_bias", False))
        return AttentionSpec(
            num_heads=int(cfg.require("num_attention_heads")),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            scale=1.0,  # the q norm sets the queries' scale
            rope=rope,
            sliding_window=None if full else int(cfg.get("sliding_window", DEFAULT_WINDOW)),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            value_norm=True,
            values_from_keys=full and bool(cfg.get("attention_k_eq_v")),
            kv_source=source,
            # An image's tokens see each other in the sliding layers only ("vision").
            bidirectional=not full and cfg.get("use_bidirectional_attention") == "vision",
        )

    def _feed_forward(self, cfg: ModelConfig, kv_shared: bool) -> FeedForwardSpec:
        activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        wide = 2 if kv_shared and cfg.get("use_double_wide_mlp") else 1
        mlp = GatedMLPSpec(int(cfg.require("intermediate_size")) * wide, activation)
        if not cfg.get("enable_moe_block"):
            return mlp
        moe = SparseMoESpec(
            num_experts=int(cfg.require("num_experts")),
            experts_per_token=int(cfg.require("top_k_experts")),
            intermediate_size=int(cfg.require("moe_intermediate_size")),
            normalize=True,
            activation=activation,
        )
        return ParallelExpertsSpec(mlp, moe)


def _head_shape(cfg: ModelConfig, i: int, kind: str) -> tuple[int, int]:
    """Layer ``i``'s ``(head_dim, kv_heads)``: ``per_layer_config``'s where config.json has one,
    else full layers take ``global_head_dim`` (and ``num_global_key_value_heads`` where their keys
    double as values), as transformers reads them."""
    heads = int(cfg.require("num_attention_heads"))
    shape: dict[str, Any] = {
        "head_dim": int(cfg.get("head_dim", DEFAULT_HEAD_DIM)),
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
    }
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, dict):  # keyed by layer index, zero-padded ("05") in config.json
        by_index = {int(k): v for k, v in per_layer.items() if str(k).isdigit()}
        shape.update(by_index.get(i) or {})
    elif kind == FULL:
        shape["head_dim"] = int(cfg.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM)
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            shape["num_key_value_heads"] = int(cfg.get("num_global_key_value_heads"))
    return int(shape["head_dim"]), int(shape["num_key_value_heads"])
