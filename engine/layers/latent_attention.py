"""Multi-head latent attention as a mixer kind: its spec, where checkpoints keep its weights, how
they become a :class:`~engine.modules.latent_attention.LatentAttention`, and the compressed rows
it keeps per position (:class:`~engine.cache.state.LatentPages`, not keys and values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from engine.cache.state import LatentPages
from engine.layers.kind import MixerKind
from engine.layers.spec import MixerSpec
from engine.modules.latent_attention import LatentAttention, LatentShape
from engine.modules.rope import RopeSpec

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class LatentAttentionSpec(MixerSpec):
    """The config's names: ``num_heads`` (num_attention_heads), ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank`` (0: a plain
    ``q_proj``), ``rope_interleave``; ``bias`` (attention_bias) gives q_a_proj,
    kv_a_proj_with_mqa and o_proj a bias. ``latent_norm_eps``: the epsilon of the two low-rank
    norms, which DeepSeek fixes rather than taking ``rms_norm_eps``."""

    kind: ClassVar[str] = "latent_attention"

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    rope: RopeSpec
    q_lora_rank: int = 0
    rope_interleave: bool = False
    bias: bool = False
    latent_norm_eps: float = 1e-6

    @property
    def shape(self) -> LatentShape:
        return LatentShape(
            self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        )


@dataclass(frozen=True)
class LatentAttentionNames:
    kind: ClassVar[str] = "latent_attention"

    q: str = "self_attn.q_proj"
    q_a: str = "self_attn.q_a_proj"
    q_a_norm: str = "self_attn.q_a_layernorm"
    q_b: str = "self_attn.q_b_proj"
    kv_a: str = "self_attn.kv_a_proj_with_mqa"
    kv_a_norm: str = "self_attn.kv_a_layernorm"
    kv_b: str = "self_attn.kv_b_proj"
    o: str = "self_attn.o_proj"


def build_latent_attention(
    reader: LayerReader, spec: LatentAttentionSpec, names: LatentAttentionNames
) -> LatentAttention:
    h, shape = reader.hidden_size, spec.shape
    q_out = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    q_a_proj = q_a_norm = None
    if spec.q_lora_rank:
        q_a_proj = reader.linear(names.q_a, h, spec.q_lora_rank, spec.bias)
        q_a_norm = _latent_norm(reader, names.q_a_norm, spec.q_lora_rank, spec)
        q_proj = reader.linear(names.q_b, spec.q_lora_rank, q_out)
    else:
        q_proj = reader.linear(names.q, h, q_out)
    kv_a_proj = reader.linear(names.kv_a, h, shape.width, spec.bias)
    kv_a_norm = _latent_norm(reader, names.kv_a_norm, spec.kv_lora_rank, spec)
    kv_b_proj = reader.linear(
        names.kv_b, spec.kv_lora_rank, spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    )
    return LatentAttention(
        q_a_proj,
        q_a_norm,
        q_proj,
        kv_a_proj,
        kv_a_norm,
        kv_b_proj,
        reader.linear(names.o, spec.num_heads * spec.v_head_dim, h, spec.bias),
        shape,
        spec.scale,
        reader.rotary(spec.rope, spec.qk_rope_head_dim),
        spec.rope_interleave,
    )


def _latent_norm(reader: LayerReader, name: str, dim: int, spec: LatentAttentionSpec):
    norm = reader.norm(name, dim)
    norm.eps = spec.latent_norm_eps  # not the model's rms_norm_eps
    return norm


def latent_rows(spec: LatentAttentionSpec) -> LatentPages:
    return LatentPages(spec.shape.width)


LATENT_ATTENTION = MixerKind(LatentAttentionNames(), build_latent_attention, latent_rows)
