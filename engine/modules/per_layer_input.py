"""Per-layer inputs (Gemma 4's "per-layer embeddings", PLE): besides the residual stream, every
decoder layer reads a small vector of its own per token, made once per step from the token and
its input embedding, and adds what it makes of it to the stream after its feed-forward.

:class:`PerLayerInputs` makes them for all layers at once, ``[tokens, layers, width]``: the
token's row of a table that packs every layer's embedding (scaled by ``sqrt(width)``), plus a
projection of the input embedding (scaled by ``hidden**-0.5``, RMS-normalised per layer), the sum
scaled by ``2**-0.5``. An image's rows read the padding token's row of the table (their token ids
are placeholders) and the image features' projection. :class:`PerLayerBranch` is one layer's use
of its slice: ``norm(proj(act(gate(h)) * input))``.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.modules.linear import DenseLinear, LinearSite
from engine.modules.mlp import ACTIVATIONS


class PerLayerInputs(nn.Module):
    """``table`` ``[vocab, layers * width]``; ``projection`` a linear ``hidden -> layers * width``;
    ``norm`` an RMSNorm over ``width``; ``pad_token_id``: the row image positions read."""

    def __init__(
        self,
        table: torch.Tensor,
        projection: nn.Module,
        norm: nn.Module,
        num_layers: int,
        width: int,
        pad_token_id: int,
    ) -> None:
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)
        self.projection, self.norm = projection, norm
        self.num_layers, self.width, self.pad_token_id = num_layers, width, pad_token_id
        # The table's scale rounded to its dtype first, as the reference's scaled embedding does.
        self.table_scale = float(torch.tensor(math.sqrt(width), dtype=table.dtype))
        self.projection_scale = projection.in_features**-0.5

    def forward(
        self, input_ids: torch.Tensor, embeddings: torch.Tensor, image_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[tokens, layers, width]`` for the flat batch's ``input_ids`` and input ``embeddings``
        (image features already spliced in at ``image_rows``)."""
        if image_rows is not None and image_rows.numel():
            input_ids = input_ids.clone()
            input_ids[image_rows] = self.pad_token_id
        tokens = F.embedding(input_ids, self.table) * self.table_scale
        context = self.projection(embeddings) * self.projection_scale
        shape = (-1, self.num_layers, self.width)
        return (self.norm(context.view(shape)) + tokens.view(shape)) * 2**-0.5

    def only(self, index: int) -> PerLayerInputs:
        """The inputs of layer ``index`` alone: a copy of that layer's table columns, projection
        rows (a dense projection) and norm, whose output ``[tokens, 1, width]`` is the same as
        layer ``index``'s slice of this module's (the norm is per layer). The converter runs one
        layer at a time."""
        cols = slice(index * self.width, (index + 1) * self.width)
        projection = DenseLinear(self.projection.weight[cols].clone())
        table = self.table[:, cols].clone()
        return PerLayerInputs(table, projection, copy.deepcopy(self.norm), 1, self.width, self.pad_token_id)


class PerLayerBranch(nn.Module):
    """One layer's residual branch on its per-layer input ``x`` ``[tokens, width]``:
    ``norm(projection(act(gate(h)) * x))`` (``gate``: hidden -> width, ``projection``: back)."""

    def __init__(self, gate: nn.Module, projection: nn.Module, norm: nn.Module, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation '{activation}'")
        self.gate, self.projection, self.norm = gate, projection, norm
        self.act = ACTIVATIONS[activation]

    def quantizable_linears(self) -> list[LinearSite]:
        return [LinearSite("ple_gate", self, "gate"), LinearSite("ple_proj", self, "projection")]

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.projection(self.act(self.gate(h)) * x.to(h.dtype)))
