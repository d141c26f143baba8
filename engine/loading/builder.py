"""Assemble the module library into a model, reading each weight from a :class:`WeightStore`.

The builder knows the module library and the :class:`TensorNames` of the architecture; it is
the one place where a checkpoint key becomes a module. Linears go through :meth:`linear`, which
returns a dense or an EXL3 linear depending on what the checkpoint stores under that key.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.architectures.base import FULL, DecoderSpec, TensorNames
from engine.loading.safetensors_store import WeightStore
from engine.modules.attention import Attention
from engine.modules.decoder import CausalLM, DecoderBlock
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.mrope import MultimodalRotaryEmbedding
from engine.modules.norms import RMSNorm
from engine.modules.rope import RotaryEmbedding

Progress = Callable[[float, str], None]


class ModelBuilder:
    def __init__(
        self,
        spec: DecoderSpec,
        names: TensorNames,
        store: WeightStore,
        dtype: torch.dtype,
        device: torch.device | str,
        context: int,
        exl3_mode: str | None = None,
    ) -> None:
        self.spec, self.names, self.store = spec, names, store
        self.dtype, self.device, self.context = dtype, torch.device(device), context
        self._exl3_mode = exl3_mode

    # -- leaves ---------------------------------------------------------------------------

    def tensor(self, key: str, shape: list[int] | None = None) -> torch.Tensor:
        return self.store.get(key, dtype=self.dtype, device=self.device, shape=shape)

    def optional(self, key: str, shape: list[int]) -> torch.Tensor | None:
        return self.tensor(key, shape) if self.store.has(key) else None

    def linear(self, key: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A linear stored under ``key`` (``key.weight`` dense, or EXL3 tensors ``key.trellis`` ...)."""
        bias_t = self.optional(f"{key}.bias", [out_features]) if bias else None
        if self.store.has(f"{key}.trellis"):
            from engine.quant import load_exl3_linear

            layer = load_exl3_linear(
                self.store.get,
                key,
                in_features,
                out_features,
                mode=self.exl3_mode(),
                dtype=self.dtype,
                device=self.device,
            )
            if bias_t is not None:
                layer.bias = bias_t
            return layer.to(self.device)
        return DenseLinear(self.tensor(f"{key}.weight", [out_features, in_features]), bias_t)

    def has_linear(self, key: str) -> bool:
        """Whether the checkpoint stores a linear under ``key`` (dense or EXL3)."""
        return self.store.has(f"{key}.weight") or self.store.has(f"{key}.trellis")

    def exl3_mode(self) -> str:
        """EXL3 linears stay packed ("streaming") where the CUDA kernels decode them on the fly;
        elsewhere (CPU, or no extension) they are reconstructed once into dense weights.
        An explicit mode given to the builder wins (streaming saves memory on the CPU too)."""
        if self._exl3_mode is not None:
            return self._exl3_mode
        if self.device.type == "cuda":
            from engine import ops

            if ops.extension() is not None:
                return "streaming"
        return "dense"

    def norm(self, key: str, dim: int) -> RMSNorm:
        return RMSNorm(self.tensor(f"{key}.weight", [dim]), self.spec.norm_eps, self.spec.norm_offset)

    # -- blocks ---------------------------------------------------------------------------

    def attention(self, i: int, p: str, rope: dict[str, RotaryEmbedding]) -> Attention:
        s, n = self.spec, self.names
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        # A fused checkpoint (Phi-3) may come with its projections split: EXL3 conversions store
        # them quantized one by one under the split names (q_proj, k_proj, v_proj). Fused unless
        # the split ones are there, so a damaged fused checkpoint's error names its fused tensor.
        if n.qkv_fused and not self.has_linear(p + n.q):
            fused = self.linear(p + n.qkv_fused, s.hidden_size, q_out + 2 * kv_out, s.qkv_bias)
            qkv = ProjectionGroup([(fused, [q_out, kv_out, kv_out])])
        else:
            qkv = ProjectionGroup(
                [
                    (self.linear(p + n.q, s.hidden_size, q_out, s.qkv_bias), [q_out]),
                    (self.linear(p + n.k, s.hidden_size, kv_out, s.qkv_bias), [kv_out]),
                    (self.linear(p + n.v, s.hidden_size, kv_out, s.qkv_bias), [kv_out]),
                ]
            )
        kind = s.layer_types[i]
        return Attention(
            qkv,
            self.linear(p + n.o, q_out, s.hidden_size, s.o_bias),
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.attn_scale,
            rope[kind] if (not s.rope_layers or s.rope_layers[i]) else None,
            self.norm(p + n.q_norm, s.head_dim) if s.qk_norm else None,
            self.norm(p + n.k_norm, s.head_dim) if s.qk_norm else None,
            s.sliding_window if kind != FULL else None,
            s.attn_softcap,
        )

    def mlp(self, p: str) -> GatedMLP:
        s, n = self.spec, self.names
        h, f = s.hidden_size, s.intermediate_size
        if n.gate_up_fused and not self.has_linear(p + n.gate):
            gate_up = ProjectionGroup([(self.linear(p + n.gate_up_fused, h, 2 * f, s.mlp_bias), [f, f])])
            return GatedMLP(gate_up, self.linear(p + n.down, f, h, s.mlp_bias), s.activation)
        return self.gated_mlp(p + n.gate, p + n.up, p + n.down, f, s.mlp_bias)

    def gated_mlp(self, gate: str, up: str, down: str, f: int, bias: bool = False) -> GatedMLP:
        """A gated MLP of width ``f`` from three separately stored linears."""
        h = self.spec.hidden_size
        gate_up = ProjectionGroup([(self.linear(gate, h, f, bias), [f]), (self.linear(up, h, f, bias), [f])])
        return GatedMLP(gate_up, self.linear(down, f, h, bias), self.spec.activation)

    def moe(self, p: str) -> SparseMoE:
        """A mixture-of-experts block. Experts stored one linear each (the Hub's layout, and every
        EXL3 conversion's) are read as such; otherwise the fused 3-D ``gate_up_proj`` /
        ``down_proj`` of transformers 5 are sliced per expert (views: no copy)."""
        s, n = self.spec, self.names
        h, f, count = s.hidden_size, s.moe_intermediate_size, s.num_experts
        router = self.linear(p + n.router, h, count, False)
        fused = p + n.experts_fused
        first = p + n.expert_gate.format(e=0)
        if not self.has_linear(first) and self.store.has(f"{fused}.gate_up_proj"):
            gate_up = self.tensor(f"{fused}.gate_up_proj", [count, 2 * f, h])
            down = self.tensor(f"{fused}.down_proj", [count, h, f])
            experts = [
                GatedMLP(
                    ProjectionGroup([(DenseLinear(gate_up[e, :f]), [f]), (DenseLinear(gate_up[e, f:]), [f])]),
                    DenseLinear(down[e]),
                    s.activation,
                )
                for e in range(count)
            ]
        else:
            experts = [
                self.gated_mlp(
                    p + n.expert_gate.format(e=e),
                    p + n.expert_up.format(e=e),
                    p + n.expert_down.format(e=e),
                    f,
                )
                for e in range(count)
            ]
        shared = shared_gate = None
        if s.shared_expert_intermediate_size:
            k = p + n.shared_expert
            shared = self.gated_mlp(
                f"{k}.gate_proj", f"{k}.up_proj", f"{k}.down_proj", s.shared_expert_intermediate_size
            )
            shared_gate = self.linear(p + n.shared_expert_gate, h, 1, False)
        return SparseMoE(router, experts, s.experts_per_token, s.norm_topk_prob, shared, shared_gate)

    def block(self, i: int, rope: dict[str, RotaryEmbedding]) -> DecoderBlock:
        s, n = self.spec, self.names
        p = n.prefix + n.layer.format(i=i)
        return DecoderBlock(
            attn_in_norm=self.norm(p + n.attn_in_norm, s.hidden_size),
            attention=self.attention(i, p, rope),
            mlp_in_norm=self.norm(p + n.mlp_in_norm, s.hidden_size),
            mlp=self.moe(p) if s.is_sparse(i) else self.mlp(p),
            attn_out_norm=self.norm(p + n.attn_out_norm, s.hidden_size) if n.attn_out_norm else None,
            mlp_out_norm=self.norm(p + n.mlp_out_norm, s.hidden_size) if n.mlp_out_norm else None,
        )

    def rotary(self) -> dict[str, RotaryEmbedding]:
        """The rotary module of each layer kind: one per distinct RoPE setting, shared by the
        layers that use it."""
        by_spec: dict[int, RotaryEmbedding] = {}
        rope = {}
        for kind, rs in self.spec.rope.items():
            key = id(rs)
            if key not in by_spec:
                # Vision-language families rotate by three position axes (see engine.modules.mrope).
                rotary = MultimodalRotaryEmbedding if "mrope_section" in rs.params else RotaryEmbedding
                by_spec[key] = rotary(rs, self.spec.head_dim, self.context).to(self.device)
            rope[kind] = by_spec[key]
        return rope

    def embedding(self) -> nn.Embedding:
        s, n = self.spec, self.names
        weight = self.tensor(n.prefix + n.embed + ".weight", [s.vocab_size, s.hidden_size])
        return nn.Embedding.from_pretrained(weight, freeze=True)

    def final_norm(self) -> RMSNorm:
        return self.norm(self.names.prefix + self.names.final_norm, self.spec.hidden_size)

    def build(self, progress: Progress | None = None) -> CausalLM:
        s, n = self.spec, self.names
        rope = self.rotary()
        embedding = self.embedding()
        embed_w = embedding.weight
        blocks = []
        for i in range(s.num_layers):
            blocks.append(self.block(i, rope))
            if progress:
                progress((i + 1) / (s.num_layers + 1), f"loaded layer {i + 1}/{s.num_layers}")
        # A tied head reuses the embedding, unless a quantized head was stored for it (EXL3
        # quantizes the head separately even when the unquantized model ties it).
        if s.tie_word_embeddings and not self.store.has(f"{n.lm_head}.trellis"):
            lm_head: nn.Module = DenseLinear(embed_w)
        else:
            lm_head = self.linear(n.lm_head, s.hidden_size, s.vocab_size, False)
        model = CausalLM(
            embedding,
            blocks,
            self.final_norm(),
            lm_head,
            s.embed_scale,
            s.final_softcap,
        )
        if progress:
            progress(1.0, "model loaded")
        return model.eval()
