"""Attention as a mixer kind: its spec, where checkpoints keep its weights, how they become an
:class:`~engine.modules.attention.Attention`, and the KV pages it keeps per sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.cache.state import KVPages
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
    qk_norm_across_heads: bool = False  # ... or over all heads at once (OLMo 2/3)
    output_gate: bool = False  # q_proj also gives a gate per head (Qwen3-Next, Qwen3.5)


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


def build_attention(reader: LayerReader, spec: AttentionSpec, names: AttentionNames) -> Attention:
    h = reader.hidden_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    # A gated q_proj gives each head's query and then its gate: twice the queries' size.
    q_proj_out = 2 * q_out if spec.output_gate else q_out
    qkv = reader.projections(
        [names.q, names.k, names.v], h, [q_proj_out, kv_out, kv_out], spec.qkv_bias, names.qkv_fused
    )
    q_norm_dim, k_norm_dim = (q_out, kv_out) if spec.qk_norm_across_heads else (spec.head_dim, spec.head_dim)
    return Attention(
        qkv,
        reader.linear(names.o, q_out, h, spec.o_bias),
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.scale,
        reader.rotary(spec.rope, spec.head_dim) if spec.rope is not None else None,
        reader.norm(names.q_norm, q_norm_dim) if spec.qk_norm else None,
        reader.norm(names.k_norm, k_norm_dim) if spec.qk_norm else None,
        spec.sliding_window,
        spec.softcap,
        spec.qk_norm_across_heads,
        spec.output_gate,
    )


def kv_pages(spec: AttentionSpec) -> KVPages:
    return KVPages(spec.num_kv_heads, spec.head_dim)


ATTENTION = MixerKind(AttentionNames(), build_attention, kv_pages)
