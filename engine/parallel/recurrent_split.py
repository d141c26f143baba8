"""Recurrent mixers split by heads across ranks: gated delta nets by key heads, Mamba-2 by groups.

Every key head and the value heads it serves form an independent recurrence: its own query and
key channels and value channels through the depthwise convolution (one channel, one filter), its
own decay and write strength (``A_log``, ``dt_bias``, ``b``, ``a``), its own state matrices, and a
gated norm over each value head alone. So a rank can take whole key heads: the input projections'
matching outputs (column-parallel), the matching convolution channels and per-head parameters,
and ``out_proj``'s matching inputs (row-parallel, summed across ranks like attention's
``o_proj``). Its recurrent state is only its heads' (``local_state``). Where the key heads do not
divide across the ranks the layer stays whole on every rank.

Mamba-2 splits the same way by groups: a group's heads read its ``B`` and ``C`` and are
normalised together (the gated norm's groups are Mamba's), so a rank takes whole groups: their
heads' ``z``, ``x`` and ``dt`` outputs of ``in_proj``, their ``B`` and ``C``, the matching
convolution channels, per-head ``A_log``, ``D``, ``dt_bias``, norm weights and state, and
``out_proj``'s matching inputs. Groups that do not divide across the ranks keep the layer whole.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.cache.state import RecurrentState
from engine.modules.gated_delta_net import GatedDeltaNet, HeadGroupedProjections, SplitProjections
from engine.modules.mamba2 import Mamba2
from engine.parallel.slicing import SliceNotes, take_inputs, take_outputs


def features(heads: list[int], width: int, offset: int = 0) -> torch.Tensor:
    """The feature indices of ``heads``, ``width`` features each, in order, plus ``offset``."""
    if not heads:
        return torch.zeros(0, dtype=torch.long)
    return offset + torch.cat([torch.arange(h * width, (h + 1) * width) for h in heads])


def split_gated_delta_net(
    net: GatedDeltaNet, rank: int, world: int, notes: SliceNotes, group_split
) -> GatedDeltaNet | None:
    """Rank ``rank``'s key heads of ``net`` (in place), or None where they do not divide.
    ``group_split(group, outputs, notes)``: a :class:`ProjectionGroup` keeping the given features
    of each output (``engine.parallel.sharding``)."""
    k_heads, v_heads, dk, dv = net.k_heads, net.v_heads, net.d_k, net.d_v
    if k_heads % world:
        return None
    ratio = v_heads // k_heads
    keys = list(range(rank * k_heads // world, (rank + 1) * k_heads // world))
    values = [h * ratio + i for h in keys for i in range(ratio)]
    q, k = features(keys, dk), features(keys, dk)
    v, z = features(values, dv), features(values, dv)
    channels = torch.cat([q, k + k_heads * dk, v + 2 * k_heads * dk])
    p = net.projections
    if isinstance(p, HeadGroupedProjections):  # each key head's q, k, v, z together
        p.qkvz = take_outputs(p.qkvz, features(keys, 2 * dk + 2 * ratio * dv), notes)
        p.ba = take_outputs(p.ba, features(keys, 2 * ratio), notes)
        p.k_heads = len(keys)
    elif isinstance(p, SplitProjections):
        p.qkvz = group_split(p.qkvz, [q, k, v, z], notes)
        heads = torch.tensor(values)
        if p.ba is not None:  # b and a stacked in one matrix
            p.ba = take_outputs(p.ba, torch.cat([heads, heads + v_heads]), notes)
        else:
            p.b, p.a = take_outputs(p.b, heads, notes), take_outputs(p.a, heads, notes)
        p.heads = len(values)
    else:
        return None
    conv = net.conv
    conv.weight = nn.Parameter(conv.weight.data[channels].contiguous(), requires_grad=False)
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.data[channels].contiguous(), requires_grad=False)
    index = torch.tensor(values, device=net.A_log.device)
    net.A_log = nn.Parameter(net.A_log.data[index].contiguous(), requires_grad=False)
    net.dt_bias = nn.Parameter(net.dt_bias.data[index].contiguous(), requires_grad=False)
    net._float_params = {}  # float32 copies of the full-size parameters
    net.out_proj = take_inputs(net.out_proj, features(values, dv), rank == 0, notes)
    net.k_heads, net.v_heads = len(keys), len(values)
    return net


def split_mamba2(mamba: Mamba2, rank: int, world: int, notes: SliceNotes) -> Mamba2 | None:
    """Rank ``rank``'s groups of ``mamba`` (in place), or None where they do not divide."""
    heads, groups, d, n = mamba.heads, mamba.groups, mamba.head_dim, mamba.state_size
    if groups % world:
        return None
    per_group = heads // groups
    mine = list(range(rank * groups // world, (rank + 1) * groups // world))
    my_heads = [g * per_group + j for g in mine for j in range(per_group)]
    i, bc = mamba.intermediate, groups * n
    x = features(my_heads, d)
    b, c = features(mine, n, i), features(mine, n, i + bc)
    # in_proj gives [z | x B C | dt]; the convolution reads x B C.
    mamba.in_proj = take_outputs(
        mamba.in_proj, torch.cat([x, x + i, b + i, c + i, torch.tensor(my_heads) + 2 * i + 2 * bc]), notes
    )
    conv = mamba.conv
    channels = torch.cat([x, b, c])
    conv.weight = nn.Parameter(conv.weight.data[channels].contiguous(), requires_grad=False)
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.data[channels].contiguous(), requires_grad=False)
    index = torch.tensor(my_heads, device=mamba.A_log.device)
    for name in ("A_log", "D", "dt_bias"):
        setattr(mamba, name, nn.Parameter(getattr(mamba, name).data[index].contiguous(), requires_grad=False))
    norm = mamba.norm
    norm.weight = nn.Parameter(norm.weight.data[x.to(norm.weight.device)].contiguous(), requires_grad=False)
    mamba.out_proj = take_inputs(mamba.out_proj, x, rank == 0, notes)
    mamba.heads, mamba.groups, mamba.intermediate = len(my_heads), len(mine), len(my_heads) * d
    return mamba


def local_state(state: RecurrentState, mixer: nn.Module) -> RecurrentState:
    """``state`` as a rank holding the split ``mixer``'s heads keeps it."""
    shapes = dict(state.shapes)
    shapes["conv"] = (mixer.conv.channels, mixer.conv.kernel_size - 1)
    if isinstance(mixer, GatedDeltaNet):
        shapes["delta"] = (mixer.v_heads, mixer.d_k, mixer.d_v)
    elif isinstance(mixer, Mamba2):
        shapes["ssm"] = (mixer.heads, mixer.head_dim, mixer.state_size)
    return replace(state, shapes=shapes)
