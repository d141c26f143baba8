"""Taking a subset of a linear's outputs (column parallel) or inputs (row parallel).

A dense linear is sliced. An EXL3 linear kept packed ("streaming") is cut on its 128-wide
Hadamard blocks, which are also whole 16x16 tiles of the trellis: the output rotation works on
blocks of 128 outputs and the input rotation on blocks of 128 inputs, so a selection made of
whole blocks (in any order, repeated or not) is the same function with the blocks' tiles and
sign vectors, and nothing is quantized again. A selection that cuts a block (e.g. one KV head of
64 features) cannot be taken that way: that linear is decoded and its weight sliced
(:class:`SliceNotes` records each such case). EXL3 linears already decoded at load ("dense"
mode) are sliced like dense ones, and int8 linears (a scale per output row) keep their codes:
rows with their scales, or columns under the same scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.exl3.exl3_linear import EXL3Linear
from engine.exl3.hadamard import HADAMARD_SIZE
from engine.exl3.trellis import TILE
from engine.modules.int8 import Int8Linear
from engine.modules.linear import DenseLinear
from engine.parallel.stored_linear import StoredLinear


@dataclass
class SliceNotes:
    """Linears that had to be decoded to be split (their keys), for the caller to report, and the
    dtype their decoded weights take (the model's activations')."""

    dtype: torch.dtype = torch.float32
    decoded: list[str] = field(default_factory=list)


def take_outputs(linear: nn.Module, index: torch.Tensor, notes: SliceNotes | None = None) -> nn.Module:
    """A linear computing ``linear(x)[..., index]`` (its bias sliced alike)."""
    index = index.long()
    if isinstance(linear, StoredLinear):  # not read yet: read just these rows
        return linear.outputs(index, notes)
    if isinstance(linear, Int8Linear):  # a scale per output row: rows and scales together
        bias = None if linear.bias is None else linear.bias.data[index]
        return Int8Linear(linear.codes.data[index], linear.scale.data[index], bias, linear.key)
    if isinstance(linear, EXL3Linear) and linear.mode == "streaming":
        blocks = _whole_blocks(index, linear.out_features)
        if blocks is not None:
            cols = _tile_range(blocks)
            svh = torch.cat([linear.svh[b * HADAMARD_SIZE : (b + 1) * HADAMARD_SIZE] for b in blocks])
            bias = None if linear.bias is None else linear.bias[index]
            return _exl3(
                linear, linear.trellis[:, cols], linear.suh, svh, linear.in_features, len(index), bias
            )
        _note(notes, linear)
    weight, bias = _dense_parts(linear, notes)
    return DenseLinear(
        weight[index].contiguous(), None if bias is None else bias[index].contiguous(), _key(linear)
    )


def take_inputs(
    linear: nn.Module, index: torch.Tensor, keep_bias: bool, notes: SliceNotes | None = None
) -> nn.Module:
    """A linear computing the part of ``linear(x)`` that the inputs ``x[..., index]`` contribute:
    the row-parallel piece whose sum over a partition of the inputs is ``linear(x)``. The bias
    belongs to one piece only (``keep_bias``)."""
    index = index.long()
    if isinstance(linear, StoredLinear):  # not read yet: read just these columns
        return linear.inputs(index, keep_bias, notes)
    if isinstance(linear, Int8Linear):  # the row scales apply to any part of a row
        bias = linear.bias.data if keep_bias and linear.bias is not None else None
        return Int8Linear(linear.codes.data[:, index], linear.scale.data, bias, linear.key)
    if isinstance(linear, EXL3Linear) and linear.mode == "streaming":
        blocks = _whole_blocks(index, linear.in_features)
        if blocks is not None:
            rows = _tile_range(blocks)
            suh = torch.cat([linear.suh[b * HADAMARD_SIZE : (b + 1) * HADAMARD_SIZE] for b in blocks])
            bias = linear.bias if keep_bias else None
            return _exl3(linear, linear.trellis[rows], suh, linear.svh, len(index), linear.out_features, bias)
        _note(notes, linear)
    weight, bias = _dense_parts(linear, notes)
    return DenseLinear(weight[:, index].contiguous(), bias if keep_bias else None, _key(linear))


def _whole_blocks(index: torch.Tensor, features: int) -> list[int] | None:
    """The 128-blocks ``index`` consists of, in order, where it is exactly a sequence of whole
    blocks (the last block of the layer counts as whole up to ``features``); else None. Only the
    last block of the layer may be short, so it may only come last."""
    blocks, at, values = [], 0, index.tolist()
    while at < len(values):
        start = values[at]
        if start % HADAMARD_SIZE:
            return None
        end = min(start + HADAMARD_SIZE, features)
        if values[at : at + end - start] != list(range(start, end)):
            return None
        if end - start < HADAMARD_SIZE and at + end - start != len(values):
            return None
        blocks.append(start // HADAMARD_SIZE)
        at += end - start
    return blocks


def _tile_range(blocks: list[int]) -> torch.Tensor:
    """Trellis tile indices (16 per row or column) of the 128-blocks ``blocks``."""
    per = HADAMARD_SIZE // TILE
    return torch.tensor([b * per + t for b in blocks for t in range(per)], dtype=torch.long)


def _exl3(source: EXL3Linear, trellis, suh, svh, in_features: int, out_features: int, bias) -> EXL3Linear:
    dtype = source.bias.dtype if source.bias is not None else torch.float16
    return EXL3Linear(
        trellis.contiguous(),
        suh,
        svh,
        source.codebook,
        in_features,
        out_features,
        bias,
        mode="streaming",
        dtype=dtype,
        name=source.name,
    )


def _dense_parts(linear: nn.Module, notes: SliceNotes | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight ``(out, in)`` and bias of a dense linear, or of an EXL3 one decoded."""
    if isinstance(linear, DenseLinear):
        return linear.weight.data, None if linear.bias is None else linear.bias.data
    if isinstance(linear, EXL3Linear):
        if linear.mode == "dense":
            return linear.weight, linear.bias
        dtype = notes.dtype if notes is not None else torch.float32
        bias = None if linear.bias is None else linear.bias.to(dtype)
        return linear.reconstruct().to(dtype), bias
    raise TypeError(f"cannot split a {type(linear).__name__} across ranks")


def _key(linear: nn.Module) -> str:
    return getattr(linear, "key", "")


def _note(notes: SliceNotes | None, linear: nn.Module) -> None:
    if notes is not None:
        notes.decoded.append(_key(linear) or type(linear).__name__)
