"""The decode roofline: bytes one decode step must read, over the measured copy bandwidth.

A decode step reads every weight once (whatever the batch), plus per sequence one embedding
row and the whole KV cache of its context; of a mixture's routed experts it reads those its
tokens chose, counted at batch 1's share (``top_k`` of the layer's experts). At batch ``B`` a
step yields ``B`` tokens, so

    roofline tok/s = B * bandwidth / (weight_bytes + B * (embed_row_bytes + context * kv_bytes_per_token))

Activations, logits and the sampled token are a few KB and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.modules.moe import SparseMoE


@dataclass(frozen=True)
class DecodeBytes:
    weight_bytes: int  # every tensor a step reads in full (linears with scales, norms, head)
    embed_row_bytes: int  # one embedding row per sequence
    kv_bytes_per_token: float  # keys + values of all layers for one position

    def per_step(self, context: float, batch: int = 1) -> float:
        return self.weight_bytes + batch * (self.embed_row_bytes + context * self.kv_bytes_per_token)

    def roofline_tokens_per_s(self, bandwidth: float, context: float, batch: int = 1) -> float:
        return batch * bandwidth / self.per_step(context, batch)


def module_decode_bytes(module: nn.Module, embedding: torch.Tensor, kv_bytes_per_token: float) -> DecodeBytes:
    """Bytes per decode step of ``module``, whose input embedding table is ``embedding``.

    Each tensor is counted once (a tied head shares the embedding's storage, and then the head
    reads it all); the embedding table alone contributes one row per sequence.
    """
    seen: dict[int, tuple[torch.Tensor, set[str]]] = {}
    named = list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    )
    for name, t in named:
        if t is None:
            continue
        entry = seen.setdefault(t.data_ptr(), (t, set()))
        entry[1].add(name)
    share = _routed_shares(module)
    total = 0
    emb_ptr = embedding.data_ptr()
    for ptr, (t, names) in seen.items():
        if ptr == emb_ptr and len(names) == 1:
            continue  # untied embedding: only its rows are read
        total += round(t.numel() * t.element_size() * share.get(ptr, 1.0))
    row = embedding.shape[-1] * embedding.element_size()
    return DecodeBytes(total, row, kv_bytes_per_token)


def _routed_shares(module: nn.Module) -> dict[int, float]:
    """``data_ptr -> top_k / experts`` of every tensor of a mixture's routed experts: the share of
    them one token's step reads (the router and shared experts are read in full)."""
    share: dict[int, float] = {}
    for moe in module.modules():
        if isinstance(moe, SparseMoE):
            for expert in moe.experts:
                for t in (*expert.parameters(), *expert.buffers()):
                    share[t.data_ptr()] = moe.top_k / len(moe.experts)
    return share


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, bits: tuple[int, int] = (16, 16)
) -> float:
    """K+V bytes of one position, dense caches (quantized ones: use the cache's own ``nbytes``)."""
    return num_layers * kv_heads * head_dim * (bits[0] + bits[1]) / 8
