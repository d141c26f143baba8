"""What a decoder block reads besides the residual stream, carried through the converter with it.

The converter runs one block at a time over the calibration rows, whose state is the residual
stream (:mod:`engine.convert.block_runner`). Gemma 4's blocks read more: each its slice of the
per-layer inputs, made from the tokens and their input embeddings
(``engine.modules.per_layer_input``), and the layers that share keys and values read those an
earlier layer wrote. Such inputs travel as extra columns of the state, after the stream:

    [ stream (hidden) | input embeddings (hidden) | token | each sharing layer's keys, values ]

so every path that hands rows of the state to a block (the quantized and unquantized forwards,
the Hessian captures, the sensitivity pre-pass, the scale tuning's row picks) hands it their
extra inputs too. A :class:`CarriedBlock` unpacks them around its block and writes back what it
produces (the keys and values of a layer others read). The extra columns are stored times
``2**-24``, exactly (a power of two), so the converter's error measures, relative norms over
whole rows, see the residual stream: the carried numbers weigh ~1e-7 of it.

The token column holds an index into the rows of the per-layer input table that the calibration
tokens use (:func:`compact_inputs`), not the token id: the converter's table is that much smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.cache.state import KVPages, SharedPages
from engine.modules.linear import LinearSite
from engine.modules.per_layer_input import PerLayerInputs

SCALE = 2.0**-24


@dataclass(frozen=True)
class CarryLayout:
    """The columns of a carried state: the stream's ``hidden``, then the input embeddings and
    the token where the model has per-layer inputs, then ``kv``: for each layer whose keys and
    values others read, ``(first column, kv_heads, head_dim)`` of its keys, its values after."""

    hidden: int
    per_layer_inputs: bool
    kv: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    width: int = 0

    @property
    def token_column(self) -> int:
        return 2 * self.hidden


def carry_layout(spec) -> CarryLayout | None:
    """The carried columns the model ``spec`` needs, or None where its blocks read the stream
    alone."""
    mixers = [layer.mixer for layer in spec.layers]
    sources = sorted({s for m in mixers if (s := getattr(m, "kv_source", None)) is not None})
    ple = spec.per_layer_inputs is not None
    if not sources and not ple:
        return None
    h = spec.hidden_size
    column, kv = (2 * h + 1 if ple else h), {}
    for source in sources:
        producer = mixers[source]
        kv[source] = (column, producer.num_kv_heads, producer.head_dim)
        column += 2 * producer.num_kv_heads * producer.head_dim
    return CarryLayout(h, ple, kv, column)


def compact_rows(table: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the per-layer input ``table`` that the calibration tokens ``ids`` use, in
    float32, and ``ids`` as indices into them."""
    used, compact = torch.unique(ids.cpu(), return_inverse=True)
    return table[used].float(), compact


def fill(state: torch.Tensor, compact_ids: torch.Tensor, layout: CarryLayout) -> None:
    """Write the carried columns of ``state`` ``(rows, cols, width)`` whose stream columns hold
    the input embeddings: their copy and the tokens' indices where there are per-layer inputs,
    zeros for keys and values not yet written (their layers come first)."""
    h = layout.hidden
    with torch.inference_mode():
        if layout.per_layer_inputs:
            for r in range(state.shape[0]):  # a row at a time: no state-sized temporary
                state[r, :, h : 2 * h] = state[r, :, :h] * SCALE
            state[:, :, layout.token_column] = compact_ids.to(state.device, state.dtype) * SCALE
        state[:, :, (2 * h + 1 if layout.per_layer_inputs else h) :] = 0


class CarriedBlock(nn.Module):
    """Decoder block ``index`` over carried rows ``[tokens, layout.width]``: its stream columns
    replaced by the block's output, the keys and values it shares written to theirs, the rest
    passed on. ``inputs``: its per-layer inputs alone (``PerLayerInputs.only``), None without."""

    def __init__(
        self, block: nn.Module, index: int, layout: CarryLayout, inputs: PerLayerInputs | None
    ) -> None:
        super().__init__()
        self.block, self.index, self.layout, self.inputs = block, index, layout, inputs
        state = block.state
        self.source = state.source if isinstance(state, SharedPages) else None

    @property
    def state(self):
        """What the runner's cache keeps for this block: a reader of shared keys and values gets
        pages of its own, filled from the carried columns before it runs."""
        if self.source is None:
            return self.block.state
        _, heads, dim = self.layout.kv[self.source]
        return KVPages(heads, dim)

    @property
    def dynamic_decode(self) -> str | None:
        return self.block.dynamic_decode

    def quantizable_linears(self) -> list[LinearSite]:
        return self.block.quantizable_linears()

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        h = self.layout.hidden
        layer_input = None
        if self.inputs is not None:
            embeddings = x[:, h : 2 * h] / SCALE
            tokens = (x[:, self.layout.token_column] / SCALE).round().long()
            layer_input = self.inputs(tokens, embeddings)[:, 0]
        if self.source is not None:
            cache.write(batch.write_slots, *self._unpack(x, self.source))
        out = self.block(x[:, :h], batch, cache, layer_input)
        carried = x[:, h:]
        if self.index in self.layout.kv:
            keys, values = cache.read(batch.write_slots)
            carried = self._pack(carried, keys, values)
        return torch.cat([out, carried], dim=-1)

    def _unpack(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, heads, dim = self.layout.kv[layer]
        n = heads * dim
        keys, values = x[:, first : first + n], x[:, first + n : first + 2 * n]
        return (keys / SCALE).view(-1, heads, dim), (values / SCALE).view(-1, heads, dim)

    def _pack(self, carried: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        first, heads, dim = self.layout.kv[self.index]
        start, n = first - self.layout.hidden, heads * dim
        rows = carried.shape[0]
        kv = torch.cat([keys.reshape(rows, n), values.reshape(rows, n)], dim=-1).to(carried.dtype) * SCALE
        return torch.cat([carried[:, :start], kv, carried[:, start + 2 * n :]], dim=-1)
