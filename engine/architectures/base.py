"""What an architecture is: a reading of config.json into a :class:`ModelSpec` (a list of layers,
each a mixer and a feed-forward of some kind, see ``engine.layers``), and the names of its tensors
(:class:`TensorNames`).

The base class reads the fields every Hugging Face decoder shares (in both the transformers 4
and 5 spellings of config.json): attention and a gated MLP in every layer. An architecture file
states only what its family does differently, as class attributes or a short override; no maths
lives here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from engine.architectures.mtp_names import MtpNames
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionSpec
from engine.layers.gated_mlp import GatedMLPSpec
from engine.layers.sparse_moe import SparseMoESpec
from engine.layers.spec import LayerSpec, MixerSpec, ModelSpec
from engine.modules.rope import RopeSpec

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class TensorNames:
    """Where each weight lives in the checkpoint: the model's own tensors, a layer's prefix
    (``{i}`` = layer index) and norms, and its mixer's and feed-forward's weights inside the
    layer. Those are the kinds' own names (``MixerKind.names``) unless ``parts`` holds other
    ones for that kind."""

    prefix: str = "model."
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    lm_head: str = "lm_head"
    layer: str = "layers.{i}."
    mixer_norm: str = "input_layernorm"
    feed_forward_norm: str = "post_attention_layernorm"
    mixer_out_norm: str | None = None  # the sandwich norms (LayerSpec.sandwich_norms)
    feed_forward_out_norm: str | None = None
    output_scale: str = "layer_scalar"  # a layer's output scale (LayerSpec.output_scale)
    parts: tuple[Any, ...] = ()

    def part(self, default: Any) -> Any:
        """The names of ``default``'s kind: the architecture's own, else ``default``."""
        return next((p for p in self.parts if p.kind == default.kind), default)


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
    sandwich_norms: ClassVar[bool] = False
    # Where the checkpoint keeps multi-token-prediction layers (a drafter), if the family has any.
    mtp: ClassVar[MtpNames | None] = None

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        n = int(cfg.require("num_hidden_layers"))
        layer_types = tuple(cfg.get("layer_types") or self.layer_types(cfg))
        rope, rotates = self.rope_specs(cfg), self.rope_layers(cfg)
        mlp = self.mlp(cfg)
        layers = []
        for i in range(n):
            kind = layer_types[i]
            mixer = self.mixer(cfg, kind, rope.get(kind) if rotates[i] else None)
            layers.append(LayerSpec(mixer, mlp, self.sandwich_norms))
        return ModelSpec(
            vocab_size=int(cfg.require("vocab_size")),
            hidden_size=int(cfg.require("hidden_size")),
            max_position_embeddings=cfg.context_length,
            layers=tuple(layers),
            norm_eps=float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", self.default_tie)),
        )

    def mixer(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> MixerSpec:
        """The mixer of a layer of type ``layer_type`` (from ``layer_types``): attention here, full
        or sliding. A hybrid family returns its other kinds for their types."""
        return self.attention(cfg, layer_type, rope)

    def attention(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> AttentionSpec:
        """A layer's attention: grouped KV heads, q/k/v and o biases as ``attention_bias`` says
        (unless the family fixes them), a window on sliding layers."""
        if layer_type not in (FULL, SLIDING):
            raise ModelLoadError(f"{cfg.directory / 'config.json'}: unsupported layer type '{layer_type}'")
        heads = int(cfg.require("num_attention_heads"))
        head_dim = int(cfg.get("head_dim") or int(cfg.require("hidden_size")) // heads)
        attention_bias = bool(cfg.get("attention_bias", False))
        return AttentionSpec(
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            rope=rope,
            sliding_window=cfg.get("sliding_window") if layer_type == SLIDING else None,
            qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=attention_bias if self.qkv_bias is None else False,
            qk_norm=self.qk_norm,
        )

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        return GatedMLPSpec(
            intermediate_size=int(cfg.require("intermediate_size")),
            activation=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            bias=bool(cfg.get("mlp_bias", False)),
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


def gemma_family(spec: ModelSpec, cfg: ModelConfig) -> ModelSpec:
    """What every Gemma shares: ``1 + w`` norms, sqrt(hidden)-scaled embeddings, a query scale
    from ``query_pre_attn_scalar``, GELU(tanh) MLPs and tied embeddings."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"

    def gemma_layer(layer: LayerSpec) -> LayerSpec:
        attention = layer.mixer
        scale = float(cfg.get("query_pre_attn_scalar", attention.head_dim)) ** -0.5
        return replace(
            layer,
            mixer=replace(attention, scale=scale, softcap=cfg.get("attn_logit_softcapping")),
            feed_forward=replace(layer.feed_forward, activation=activation),
        )

    return replace(
        spec,
        layers=tuple(map(gemma_layer, spec.layers)),
        norm_offset=1.0,
        embed_scale=math.sqrt(spec.hidden_size),
        final_softcap=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


# Where post-norm layers (post_norms) keep their norms.
POST_NORMS = TensorNames(
    mixer_out_norm="post_attention_layernorm", feed_forward_out_norm="post_feedforward_layernorm"
)


def post_norms(spec: ModelSpec) -> ModelSpec:
    """Every layer post-norm, ``h += norm(mixer(h))`` then ``h += norm(feed_forward(h))``: no norm
    before the sub-layers, one after each (OLMo 2/3, EXAONE 4)."""
    layers = tuple(replace(layer, pre_norms=False, sandwich_norms=True) for layer in spec.layers)
    return replace(spec, layers=layers)


def mixture_of_experts(spec: ModelSpec, cfg: ModelConfig, normalize: bool) -> ModelSpec:
    """The MoE layers of a Qwen-MoE or Mixtral config. A layer is sparse unless it is listed in
    ``mlp_only_layers`` or falls between ``decoder_sparse_step`` strides (Qwen), where it keeps its
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

    def moe_layer(i: int, layer: LayerSpec) -> LayerSpec:
        if not experts or i in dense or (i + 1) % step != 0:
            return layer
        mlp = layer.feed_forward
        moe = SparseMoESpec(
            num_experts=experts,
            experts_per_token=top_k,
            intermediate_size=int(cfg.get("moe_intermediate_size") or mlp.intermediate_size),
            normalize=bool(cfg.get("norm_topk_prob", normalize)),
            activation=mlp.activation,
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )
        return replace(layer, feed_forward=moe)

    return replace(spec, layers=tuple(moe_layer(i, layer) for i, layer in enumerate(spec.layers)))
