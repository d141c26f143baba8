"""What an architecture is: a reading of config.json into a :class:`DecoderSpec`, and the names
of its tensors (:class:`TensorNames`).

The base class reads the fields every Hugging Face decoder shares (in both the transformers 4
and 5 spellings of config.json). An architecture file states only what its family does
differently, as class attributes or a short override; no maths lives here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.modules.rope import RopeSpec

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class TensorNames:
    """Where each weight of the module library lives in the checkpoint (``{i}`` = layer index)."""

    prefix: str = "model."
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    lm_head: str = "lm_head"
    layer: str = "layers.{i}."
    attn_in_norm: str = "input_layernorm"
    attn_out_norm: str | None = None
    mlp_in_norm: str = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv_fused: str | None = None
    o: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    gate_up_fused: str | None = None
    down: str = "mlp.down_proj"
    # Mixture-of-experts layers ({e} = expert index): the router, each expert's projections as the
    # Hub checkpoints store them, and the fused 3-D ``gate_up_proj`` [experts, 2 * f, hidden] /
    # ``down_proj`` [experts, hidden, f] that transformers 5 keeps in memory, under ``experts_fused``.
    router: str = "mlp.gate"
    expert_gate: str = "mlp.experts.{e}.gate_proj"
    expert_up: str = "mlp.experts.{e}.up_proj"
    expert_down: str = "mlp.experts.{e}.down_proj"
    experts_fused: str = "mlp.experts"
    shared_expert: str = "mlp.shared_expert"  # Qwen2-MoE: an always-on expert ...
    shared_expert_gate: str = "mlp.shared_expert_gate"  # ... scaled by sigmoid(this linear)


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the module library needs to assemble one decoder-only model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    rope: dict[str, RopeSpec] = field(hash=False)
    rope_layers: tuple[bool, ...] = ()  # False where a layer uses no positional rotation (NoPE)
    sliding_window: int | None = None
    attn_scale: float = 0.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    activation: str = "silu"
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    # Mixture of experts: True where a layer's MLP is a sparse MoE block (empty: a dense model).
    sparse_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    def is_sparse(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is a mixture-of-experts block."""
        return bool(self.sparse_layers) and self.sparse_layers[i]


def _rope_from_params(params: dict[str, Any], cfg: ModelConfig, default_theta: float) -> RopeSpec:
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta") or default_theta
    partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor", 1.0)
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    return RopeSpec(float(theta), kind, extra, float(partial), cfg.context_length)


class Architecture:
    """The common reading of a decoder config; subclasses override what their family changes."""

    hf_names: ClassVar[tuple[str, ...]] = ()
    names: ClassVar[TensorNames] = TensorNames()
    qkv_bias: ClassVar[bool | None] = None  # None: read 'attention_bias' from the config
    qk_norm: ClassVar[bool] = False
    default_tie: ClassVar[bool] = False

    def spec(self, cfg: ModelConfig) -> DecoderSpec:
        hidden = int(cfg.require("hidden_size"))
        heads = int(cfg.require("num_attention_heads"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        layer_types = tuple(cfg.get("layer_types") or self.layer_types(cfg))
        return DecoderSpec(
            vocab_size=int(cfg.require("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(cfg.require("intermediate_size")),
            num_layers=int(cfg.require("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            norm_eps=float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or 1e-6),
            max_position_embeddings=cfg.context_length,
            layer_types=layer_types,
            rope=self.rope_specs(cfg),
            rope_layers=tuple(self.rope_layers(cfg)),
            sliding_window=cfg.get("sliding_window") if SLIDING in layer_types else None,
            attn_scale=head_dim**-0.5,
            qkv_bias=qkv_bias,
            o_bias=attention_bias if self.qkv_bias is None else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=self.qk_norm,
            activation=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", self.default_tie)),
        )

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        """The checkpoint's tensor names; ``has(key)`` lets multimodal families choose among the
        nestings their checkpoints are saved with."""
        return self.names

    def vision_model(self, cfg: ModelConfig, store: Any, dtype: Any, device: Any) -> Any:
        """The image path (``engine.vision.base.VisionModel``) of a vision-language family;
        None for text-only models."""
        return None

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Layer kinds when config.json does not list them: Qwen-style ``use_sliding_window``
        (sliding from ``max_window_layers`` on), else every layer full attention."""
        n = int(cfg.require("num_hidden_layers"))
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            first = int(cfg.get("max_window_layers", 0))
            return [SLIDING if i >= first else FULL for i in range(n)]
        return [FULL] * n

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        return [True] * int(cfg.require("num_hidden_layers"))

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        """RoPE per layer kind, from transformers 5's ``rope_parameters`` (flat or per kind) or
        transformers 4's ``rope_theta`` + ``rope_scaling``."""
        theta = float(cfg.get("rope_theta", 10000.0))
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and (FULL in params or SLIDING in params):
            specs = {kind: _rope_from_params(p, cfg, theta) for kind, p in params.items()}
            specs.setdefault(SLIDING, specs.get(FULL))
            specs.setdefault(FULL, specs.get(SLIDING))
            return specs
        if not isinstance(params, dict):
            params = dict(cfg.get("rope_scaling") or {})
        spec = _rope_from_params(params, cfg, theta)
        return {FULL: spec, SLIDING: spec}


def gemma_family(spec: DecoderSpec, cfg: ModelConfig) -> DecoderSpec:
    """What every Gemma shares: ``1 + w`` norms, sqrt(hidden)-scaled embeddings, a query scale
    from ``query_pre_attn_scalar``, GELU(tanh) MLPs and tied embeddings."""
    return replace(
        spec,
        norm_offset=1.0,
        embed_scale=math.sqrt(spec.hidden_size),
        attn_scale=float(cfg.get("query_pre_attn_scalar", spec.head_dim)) ** -0.5,
        activation=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def mixture_of_experts(spec: DecoderSpec, cfg: ModelConfig, normalize: bool) -> DecoderSpec:
    """The MoE fields of a Qwen-MoE or Mixtral config. A layer is sparse unless it is listed in
    ``mlp_only_layers`` or falls between ``decoder_sparse_step`` strides (Qwen), where it keeps a
    dense MLP of ``intermediate_size``. ``normalize`` is the family's default for
    ``norm_topk_prob`` (Mixtral has no such field and always renormalises)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.require("num_experts_per_tok")) if experts else 0
    if experts and not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"{cfg.directory / 'config.json'}: num_experts_per_tok is {top_k}, "
            f"but the model has {experts} experts"
        )
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(spec.num_layers))
    return replace(
        spec,
        sparse_layers=sparse,
        num_experts=experts,
        experts_per_token=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or spec.intermediate_size),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", normalize)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
