"""A linear not read yet: what a tensor-parallel rank's model holds until it knows its part.

A rank builds its model with :class:`StoredLinear` placeholders (``shard_loading``), so that the
split (:mod:`engine.parallel.sharding`, through :func:`~engine.parallel.slicing.take_outputs`
and ``take_inputs``) reads only the rows or columns it keeps, from the memory-mapped file:

- a dense weight: the span of its selected rows (columns), with ``get_slice``;
- an int8 one: those rows' codes and scales, or those columns' codes under every row's scale;
- an EXL3 one kept packed: the selected 128-wide blocks' tiles of the trellis and their slice of
  the sign vector, where the selection is a run of whole blocks. A selection that cuts a block
  (or an EXL3 linear decoded at load) reads that one linear whole, decodes it and cuts it.

A placeholder the split does not touch (a layer kept whole on every rank, a router) is read
whole afterwards (:func:`load_stored`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.exl3.hadamard import HADAMARD_SIZE
from engine.exl3.trellis import TILE
from engine.modules.int8 import Int8Linear
from engine.modules.linear import DenseLinear

if TYPE_CHECKING:
    from engine.loading.builder import ModelBuilder
    from engine.parallel.slicing import SliceNotes


class StoredLinear(nn.Module):
    """The linear stored under ``key`` (``[out_features, in_features]``), read when its part is
    asked for (:meth:`outputs`, :meth:`inputs`) or whole (:meth:`load`). ``bias_key``: where its
    bias is stored (None: no bias)."""

    def __init__(
        self,
        builder: ModelBuilder,
        read_whole: Callable[[], nn.Module],
        key: str,
        in_features: int,
        out_features: int,
        bias_key: str | None,
    ) -> None:
        super().__init__()
        self._builder, self._read_whole = builder, read_whole
        self.key, self.in_features, self.out_features, self.bias_key = (
            key,
            in_features,
            out_features,
            bias_key,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"linear '{self.key}' was never read (engine.parallel.stored_linear.load_stored)")

    def load(self) -> nn.Module:
        """The whole linear, as the single-process builder reads it."""
        return self._read_whole()

    def outputs(self, index: torch.Tensor, notes: SliceNotes | None) -> nn.Module:
        """A linear computing ``self(x)[..., index]``, reading only the stored rows it needs."""
        from engine.parallel.slicing import take_outputs

        if not self._reads_parts(index):
            return take_outputs(self.load(), index, notes)
        bias = self._bias()
        bias = None if bias is None else bias[index.to(bias.device)].contiguous()
        part = self._part(index, 0, notes)
        if part is None:
            return take_outputs(self.load(), index, notes)
        return part(bias)

    def inputs(self, index: torch.Tensor, keep_bias: bool, notes: SliceNotes | None) -> nn.Module:
        """The row-parallel piece of ``self`` for the inputs ``index`` (see ``take_inputs``),
        reading only the stored columns it needs."""
        from engine.parallel.slicing import take_inputs

        if not self._reads_parts(index):
            return take_inputs(self.load(), index, keep_bias, notes)
        part = self._part(index, 1, notes)
        if part is None:
            return take_inputs(self.load(), index, keep_bias, notes)
        return part(self._bias() if keep_bias else None)

    # -- reading parts -------------------------------------------------------------------------

    def _reads_parts(self, index: torch.Tensor) -> bool:
        store = self._builder.store
        return hasattr(store, "get_part") and index.numel() > 0

    def _bias(self) -> torch.Tensor | None:
        if self.bias_key is None:
            return None
        return self._builder.optional(self.bias_key, [self.out_features])

    def _part(self, index: torch.Tensor, dim: int, notes: SliceNotes | None) -> Callable | None:
        """A function of the bias building the part of features ``index`` along ``dim`` (0: out,
        1: in) of the weight, its stored span already read; None where only the whole linear
        will do (an EXL3 selection that is not a run of whole blocks)."""
        b, store = self._builder, self._builder.store
        weight_key = f"{self.key}.weight"
        start, end = int(index.min()), int(index.max()) + 1
        local = index - start
        if b.keeps_int8(weight_key):
            codes, scale = store.int8_part(weight_key, dim, start, end)
            self._check_span(codes, dim, end - start)
            if dim == 0:
                return lambda bias: Int8Linear(
                    codes[local].contiguous(), scale[local].contiguous(), bias, self.key
                )
            return lambda bias: Int8Linear(codes[:, local].contiguous(), scale, bias, self.key)
        if store.has(f"{self.key}.trellis"):
            return self._exl3_part(index, dim)
        weight = store.get_part(weight_key, dim, start, end, dtype=b.dtype, device=b.device)
        self._check_span(weight, dim, end - start)
        local = local.to(weight.device)
        weight = weight[local] if dim == 0 else weight[:, local]
        return lambda bias: DenseLinear(weight.contiguous(), bias, self.key)

    def _check_span(self, part: torch.Tensor, dim: int, span: int) -> None:
        expected = [span, self.in_features] if dim == 0 else [self.out_features, span]
        if list(part.shape) != expected:
            raise ModelLoadError(
                f"tensor '{self.key}.weight' does not have the shape [{self.out_features}, "
                f"{self.in_features}] its layer expects"
            )

    def _exl3_part(self, index: torch.Tensor, dim: int) -> Callable | None:
        from engine.exl3 import load_exl3_linear
        from engine.parallel.slicing import _whole_blocks

        b, store = self._builder, self._builder.store
        features = self.out_features if dim == 0 else self.in_features
        blocks = _whole_blocks(index.long(), features) if b.exl3_mode() == "streaming" else None
        if not blocks or blocks != list(range(blocks[0], blocks[0] + len(blocks))):
            return None  # decoded whole and cut (take_outputs/take_inputs note it)
        tiles = (blocks[0] * HADAMARD_SIZE // TILE, (blocks[-1] + 1) * HADAMARD_SIZE // TILE)
        span = (blocks[0] * HADAMARD_SIZE, (blocks[-1] + 1) * HADAMARD_SIZE)
        # The trellis is [in tiles, out tiles, ...]; svh rotates the outputs, suh the inputs.
        trellis_dim, vectors = (1, ("svh", "sv")) if dim == 0 else (0, ("suh", "su"))

        def get(name: str) -> torch.Tensor:
            suffix = name.rsplit(".", 1)[1]
            if suffix == "trellis":
                return store.get_part(name, trellis_dim, *tiles)
            if suffix in vectors:
                return store.get_part(name, 0, *span)
            if suffix == "bias":  # the caller's, cut to the part
                raise KeyError(name)
            return store.get(name)

        n = len(index)
        in_features, out_features = (self.in_features, n) if dim == 0 else (n, self.out_features)

        def build(bias: torch.Tensor | None) -> nn.Module:
            layer = load_exl3_linear(
                get, self.key, in_features, out_features, mode="streaming", dtype=b.dtype, device=b.device
            )
            if bias is not None:
                layer.bias = bias
            return layer.to(b.device)

        return build


def load_stored(module: nn.Module) -> int:
    """Read whole every :class:`StoredLinear` left in ``module`` (the ones no split took a part
    of), in place; returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, StoredLinear):
                setattr(parent, name, child.load())
                count += 1
    return count
