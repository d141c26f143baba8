"""Tensor parallelism as a transformation of a loaded module tree: :func:`shard_model` keeps, on
rank ``rank`` of ``world``, that rank's part of every layer.

- Attention: split by KV-head groups (:mod:`engine.parallel.heads`; KV heads replicated where
  they do not divide): q/k/v column-parallel, ``o_proj`` row-parallel, the sum across ranks
  taken once after the layer (:class:`~engine.parallel.reduced.AllReduced`).
- Gated and plain MLPs: gate/up (fc1) column-parallel, down (fc2) row-parallel, summed likewise.
- Mixtures of experts: the routed experts dealt round-robin across ranks (router replicated,
  a rank's absent experts contribute zeros), the shared expert split like an MLP; one sum.
  Latent mixtures (NemotronH) are replicated.
- Embedding and LM head: vocabulary-parallel (:mod:`engine.parallel.vocab`).
- Gated delta nets and Mamba-2: split by key heads or groups where they divide
  (:mod:`engine.parallel.recurrent_split`), ``out_proj`` row-parallel and summed likewise.
- Other recurrent mixers (short convolution), latent attention, attention with a
  query/key norm across all heads (OLMo) and anything else not listed are replicated: every
  rank computes them whole, from the same input, and keeps their state (always correct, only
  not divided).

Every rank runs every block and the same collectives in the same order, so the ranks' collective
calls always pair up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.cache.state import KVPages, RecurrentState
from engine.errors import UsageError
from engine.modules.attention import Attention
from engine.modules.decoder import CausalLM
from engine.modules.feed_forward import FeedForward
from engine.modules.gated_delta_net import GatedDeltaNet
from engine.modules.linear import ProjectionGroup
from engine.modules.mamba2 import Mamba2
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.parallel.heads import head_shard
from engine.parallel.recurrent_split import local_state, split_gated_delta_net, split_mamba2
from engine.parallel.reduced import AllReduced
from engine.parallel.slicing import SliceNotes, take_inputs, take_outputs
from engine.parallel.vocab import VocabParallelEmbedding, VocabParallelHead


@dataclass
class ShardReport:
    """What :func:`shard_model` did that a user may want to know: layers kept whole on every rank
    (by kind), and EXL3 linears decoded because their split cuts a Hadamard block."""

    replicated: dict[str, list[int]] = field(default_factory=dict)
    decoded: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"{kind} layers {layers} replicated on every rank" for kind, layers in self.replicated.items()]
        if self.decoded:
            out.append(f"{len(self.decoded)} EXL3 linears decoded to be split: {', '.join(self.decoded)}")
        return out


def shard_model(module: CausalLM, rank: int, world: int, grouped: bool = False) -> ShardReport:
    """Turn ``module`` (a whole model, on this rank's device) into rank ``rank``'s shard, in place.
    ``grouped``: with ``world`` 1, shard all the same (every part whole, the collectives kept: a
    test's run of one rank in a process group); else one rank keeps the model as it is."""
    report = ShardReport()
    if world == 1 and not grouped:
        return report
    if module.per_layer_inputs is not None:
        raise UsageError("tensor parallelism does not support per-layer inputs (Gemma 4) yet")
    notes = SliceNotes(dtype=module.dtype)
    if isinstance(module.embedding, VocabParallelEmbedding):  # read as the rank's slice already
        vocab = module.embedding.vocab
    else:
        vocab = module.embedding.weight.shape[0]
        module.embedding = VocabParallelEmbedding.from_embedding(module.embedding, rank, world)
    if not isinstance(module.lm_head, VocabParallelHead):  # else: a tied head read as the slice
        head_vocab = getattr(module.lm_head, "out_features", vocab)
        module.lm_head = VocabParallelHead.from_linear(module.lm_head, head_vocab, rank, world, notes)
    for i, block in enumerate(module.blocks):
        if block.per_layer_input is not None:
            raise UsageError("tensor parallelism does not support per-layer inputs (Gemma 4) yet")
        if isinstance(block.mixer, Attention) and not block.mixer.qk_norm_across_heads:
            block.mixer = AllReduced(shard_attention(block.mixer, rank, world, notes))
        elif isinstance(block.mixer, GatedDeltaNet) and (
            net := split_gated_delta_net(block.mixer, rank, world, notes, _split_group)
        ):
            block.mixer = AllReduced(net)
        elif isinstance(block.mixer, Mamba2) and (mamba := split_mamba2(block.mixer, rank, world, notes)):
            block.mixer = AllReduced(mamba)
        elif block.mixer is not None:
            report.replicated.setdefault(type(block.mixer).__name__, []).append(i)
        if block.feed_forward is not None:
            sharded = shard_feed_forward(block.feed_forward, rank, world, notes)
            if sharded is None:
                report.replicated.setdefault(type(block.feed_forward).__name__, []).append(i)
            else:
                block.feed_forward = AllReduced(sharded)
    report.decoded = notes.decoded
    return report


def local_states(states: list, module: CausalLM) -> list:
    """The per-layer states (``engine.layers.sequence_states``) this rank's cache keeps: each
    attention layer's own KV heads, each split gated delta net's own heads' state."""
    out = []
    for state, block in zip(states, module.blocks):
        mixer = getattr(block.mixer, "inner", block.mixer)
        if isinstance(state, KVPages) and isinstance(mixer, Attention):
            state = KVPages(mixer.num_kv_heads, state.head_dim)
        elif isinstance(state, RecurrentState) and isinstance(block.mixer, AllReduced):
            state = local_state(state, mixer)  # a split gated delta net or Mamba-2
        out.append(state)
    return out


# -- attention ---------------------------------------------------------------------------------


def shard_attention(attn: Attention, rank: int, world: int, notes: SliceNotes) -> Attention:
    """Rank ``rank``'s heads of ``attn`` (in place). A norm across all heads (OLMo) needs every
    head: such layers stay whole (``shard_model`` does not split them)."""
    if attn.qk_norm_across_heads:
        raise ValueError("a query/key norm across all heads needs every head")
    if attn.shared_kv:
        raise UsageError("tensor parallelism does not support layers sharing another's keys yet")
    heads = head_shard(attn.num_heads, attn.num_kv_heads, rank, world)
    d = attn.head_dim
    q_width = 2 * d if attn.output_gate else d  # a gated q_proj gives each head's query and gate
    q_index = _features(heads.q_heads, q_width)
    kv_index = _features(heads.kv_heads, d)
    outputs = [q_index, kv_index] if attn.values_from_keys else [q_index, kv_index, kv_index]
    attn.qkv = _split_group(attn.qkv, outputs, notes)
    if attn.gate_proj is not None:
        gate_index = torch.tensor(heads.q_heads) if attn.gate_per_head else _features(heads.q_heads, d)
        attn.gate_proj = take_outputs(attn.gate_proj, gate_index, notes)
    if attn.sinks is not None:
        attn.sinks = attn.sinks[torch.tensor(heads.q_heads, device=attn.sinks.device)].contiguous()
    attn.o_proj = take_inputs(attn.o_proj, _features(heads.q_heads, d), rank == 0, notes)
    attn.num_heads, attn.num_kv_heads = len(heads.q_heads), len(heads.kv_heads)
    return attn


def _features(heads: list[int], width: int) -> torch.Tensor:
    """The feature indices of ``heads``, ``width`` features each, in order."""
    return (
        torch.cat([torch.arange(h * width, (h + 1) * width) for h in heads])
        if heads
        else torch.zeros(0, dtype=torch.long)
    )


def _split_group(group: ProjectionGroup, outputs: list[torch.Tensor], notes: SliceNotes) -> ProjectionGroup:
    """``group`` keeping features ``outputs[i]`` of its ``i``-th output (a fused linear's outputs
    are cut from its one matrix, each at its offset)."""
    parts, at = [], 0
    for linear, splits in zip(group.linears, group.splits):
        mine = outputs[at : at + len(splits)]
        offsets = [sum(splits[:j]) for j in range(len(splits))]
        index = torch.cat([o + idx for o, idx in zip(offsets, mine)])
        parts.append((take_outputs(linear, index, notes), [len(idx) for idx in mine]))
        at += len(splits)
    return ProjectionGroup(parts, group.output_keys)


# -- feed-forwards -----------------------------------------------------------------------------


def shard_feed_forward(ff: nn.Module, rank: int, world: int, notes: SliceNotes) -> nn.Module | None:
    """Rank ``rank``'s part of a feed-forward (to be summed across ranks), or None where this kind
    is kept whole on every rank."""
    if isinstance(ff, GatedMLP):
        return _shard_gated(ff, rank, world, notes)
    if isinstance(ff, FeedForward):
        index = _chunk(ff.fc1.out_features, rank, world)
        ff.fc1 = take_outputs(ff.fc1, index, notes)
        ff.fc2 = take_inputs(ff.fc2, index, rank == 0, notes)
        return ff
    if isinstance(ff, SparseMoE):
        return _shard_moe(ff, rank, world, notes)
    return None


def _chunk(size: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``size`` features: in whole 128-blocks where they divide (so that
    EXL3 linears split without decoding), else in near-equal runs."""
    if size % (128 * world) == 0:
        per = size // world
        return torch.arange(rank * per, (rank + 1) * per)
    return torch.arange(size).tensor_split(world)[rank]


def _shard_gated(mlp: GatedMLP, rank: int, world: int, notes: SliceNotes) -> GatedMLP:
    index = _chunk(mlp.gate_up.splits[0][0], rank, world)  # gate's width, fused with up or not
    mlp.gate_up = _split_group(mlp.gate_up, [index, index], notes)
    mlp.down = take_inputs(mlp.down, index, rank == 0, notes)
    return mlp


class AbsentExpert(nn.Module):
    """An expert another rank computes: it contributes zeros here (the mix adds nothing)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.width)


def _shard_moe(moe: SparseMoE, rank: int, world: int, notes: SliceNotes) -> SparseMoE | None:
    if moe.latent_in is not None:  # NemotronH's latent mixture: kept whole on every rank
        return None
    for e, expert in enumerate(moe.experts):
        if e % world != rank:
            moe.experts[e] = AbsentExpert(_out_width(expert))
    # The device-routed kernels index every expert's stacked weights: not with experts absent.
    moe.stacked = None
    if moe.shared is not None:
        shared = shard_feed_forward(moe.shared, rank, world, notes)
        if shared is None:  # a shared expert of another kind runs on rank 0 only
            moe.shared = moe.shared if rank == 0 else None
        else:
            moe.shared = shared
    return moe


def _out_width(expert: nn.Module) -> int:
    down = getattr(expert, "down", None) or getattr(expert, "fc2", None)
    return down.out_features
