"""Attention as a mixer kind: its spec, where checkpoints keep its weights, how they become an
:class:`~engine.modules.attention.Attention`, and the KV pages it keeps per sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.cache.state import KVPages, SharedPages
from engine.layers.kind import MixerKind
from engine.layers.spec import MixerSpec
from engine.modules.attention import Attention
from engine.modules.rope import RopeSpec

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class AttentionSpec(MixerSpec):
    kind: ClassVar[str] = "attention"

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rope: RopeSpec | None = None  # None: no positional rotation (SmolLM3's NoPE layers)
    sliding_window: int | None = None
    softcap: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm of queries and keys: per head ...
    qk_norm_across_heads: bool = False  # ... or over all heads at once (OLMo 2/3) ...
    qk_norm_head_scales: bool = False  # ... or per head with a scale of its own for each (Cohere)
    output_gate: bool = False  # q_proj also gives a gate per head (Qwen3-Next, Qwen3.5)
    sinks: bool = False  # a learned sink logit per head in the softmax (GPT-OSS)
    # An output gate from a projection of its own (AttentionNames.gate): "per_feature", one per
    # output feature (AFMoE), or "per_head", one per head (Step 3.5); None: no such projection.
    gate_proj: str | None = None
    # Gemma 4: values RMS-normalised per head with no learned scale; keys doubling as values (no
    # v_proj: the values are the key projection before its norm and rotation; attention_k_eq_v);
    # layers that read the keys and values the earlier layer ``kv_source`` wrote, projecting only
    # queries and keeping no cache of their own (num_kv_shared_layers).
    value_norm: bool = False
    values_from_keys: bool = False
    kv_source: int | None = None
    # False: causal whatever the prompt, also over an image's tokens, which attend to each other
    # in the other layers (Gemma 4's full layers; engine.modules.batch.SequenceSlice.bidirectional).
    bidirectional: bool = True


@dataclass(frozen=True)
class AttentionNames:
    kind: ClassVar[str] = "attention"

    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv_fused: str | None = None  # one matrix for all three (Phi-3's qkv_proj)
    o: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    sinks: str = "self_attn.sinks"
    gate: str = "self_attn.gate_proj"


def build_attention(reader: LayerReader, spec: AttentionSpec, names: AttentionNames) -> Attention:
    h = reader.hidden_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    # A gated q_proj gives each head's query and then its gate: twice the queries' size.
    q_proj_out = 2 * q_out if spec.output_gate else q_out
    if spec.kv_source is not None:  # queries only: the keys and values are another layer's
        qkv = reader.projections([names.q], h, [q_proj_out], spec.qkv_bias)
    elif spec.values_from_keys:
        qkv = reader.projections([names.q, names.k], h, [q_proj_out, kv_out], spec.qkv_bias)
    else:
        qkv = reader.projections(
            [names.q, names.k, names.v], h, [q_proj_out, kv_out, kv_out], spec.qkv_bias, names.qkv_fused
        )
    keys = spec.qk_norm and spec.kv_source is None  # a reader of shared keys has no key norm
    q_norm_dim, k_norm_dim = _qk_norm_shapes(spec)
    return Attention(
        qkv,
        reader.linear(names.o, q_out, h, spec.o_bias),
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.scale,
        reader.rotary(spec.rope, spec.head_dim) if spec.rope is not None else None,
        reader.norm(names.q_norm, q_norm_dim) if spec.qk_norm else None,
        reader.norm(names.k_norm, k_norm_dim) if keys else None,
        spec.sliding_window,
        spec.softcap,
        spec.qk_norm_across_heads,
        spec.output_gate,
        # float32 whatever the model's dtype: they join the float32 softmax (stored bf16: exact)
        reader.tensor(names.sinks, [spec.num_heads], torch.float32) if spec.sinks else None,
        gate_proj=_gate_proj(reader, spec, names),
        gate_per_head=spec.gate_proj == "per_head",
        value_norm=reader.unscaled_norm(spec.head_dim) if spec.value_norm else None,
        values_from_keys=spec.values_from_keys,
        shared_kv=spec.kv_source is not None,
        bidirectional=spec.bidirectional,
    )


def _qk_norm_shapes(spec: AttentionSpec) -> tuple[int | tuple[int, int], int | tuple[int, int]]:
    """The q and k norms' scales: over all heads at once, one per head, or one shared by all."""
    if spec.qk_norm_across_heads:
        return spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if spec.qk_norm_head_scales:
        return (spec.num_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)
    return spec.head_dim, spec.head_dim


def _gate_proj(reader: LayerReader, spec: AttentionSpec, names: AttentionNames) -> nn.Module | None:
    """The output gate's own projection: as wide as the heads' outputs, or one per head."""
    if spec.gate_proj is None:
        return None
    widths = {"per_feature": spec.num_heads * spec.head_dim, "per_head": spec.num_heads}
    if spec.gate_proj not in widths:
        raise ValueError(f"unknown attention gate '{spec.gate_proj}' (one of {', '.join(widths)})")
    return reader.linear(names.gate, reader.hidden_size, widths[spec.gate_proj])


def kv_pages(spec: AttentionSpec) -> KVPages | SharedPages:
    if spec.kv_source is not None:
        return SharedPages(spec.kv_source)
    return KVPages(spec.num_kv_heads, spec.head_dim)


ATTENTION = MixerKind(AttentionNames(), build_attention, kv_pages)
